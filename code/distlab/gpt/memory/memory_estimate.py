"""Predict a rank's peak memory before running: model states plus activations.

Notation: L layers, h hidden, a heads, s sequence, b micro batch, V padded vocabulary,
P parameters on this rank, tp / pp / dp / cp the parallel sizes, M micro-batches per step.

**Model states** (bytes per parameter, K the optimizer's)::

    precision                     parameters  gradients  optimizer (Adam)             total
    fp32                          4           4          8   (exp_avg + exp_avg_sq)   16
    mixed, ZeRO's count (DS)      2           2          12  (fp32 master + moments)  16
    mixed, Megatron-LM fp16       2           2 + 4      12  (fp32 main grad too)     20
    mixed, Megatron-LM bf16       2           4          12  (grads kept in fp32)     18
    this engine, fp16/bf16        4 (+2)      4          8   (fp32 weights; autocast's half copies
                                                              of the weights live through fwd/bwd)

ZeRO's count is Rajbhandari et al. (2020), the one DeepSpeed's mixed precision has. Megatron-LM's
table (its distributed-optimizer documentation, without the distributed optimizer) gives 20 bytes
with fp16 parameters and gradients (the gradients are copied to fp32 main gradients for the step)
and 18 with bf16 parameters and fp32 gradients; its distributed optimizer shards the fp32 main
parameters and moments (with fp16, the fp32 main gradients too): 4 + 16/dp and 6 + 12/dp. This
engine's (``--use-distributed-optimizer``) keeps bf16 parameters under --bf16, as Megatron does:
8 + 8/d (fp32), 6 + 12/d (bf16), 4 + 16/d (bf16 with --grad-reduce-in-bf16), d = dp x cp.

ZeRO stage 1 divides the optimizer state by dp, stage 2 also the gradients, stage 3 also the
parameters; offload moves the optimizer state (stage 3: also the parameters) to the CPU.

**Activations per layer** (Korthikanti et al. 2022) in half precision, with dropout and the
attention scores stored::

    s b h (34 + 5 a s / h) bytes  = attention 11 sbh + 5 a s^2 b, MLP 19 sbh, 2 LayerNorms 4 sbh

This course's GPT has no dropout (dropout 0). In units of s b h values (t = tp), one block keeps::

    residual stream (LN1 and LN2 inputs), always fp32                          2
    LN1 and LN2 outputs (qkv and fc1 inputs), whole on every tp rank           2
    q k v 3, attention output = proj input 1, GeLU input 4, fc2 input 4       12 / t
      (Llama: q and output 2 a d / h, K/V 2 g d / h (fused attention keeps the g
      grouped heads), SwiGLU's gate, up, silu(gate), product 4 F / h; each RMSNorm
      also its normalised input, fp32: + 2 with the residual stream's terms)
    --attention-backend unfused|local only: the softmax probabilities,
      a s / h (the b a s^2 / t scores), fp32 and, under autocast, a half copy   a s / (h t)

PyTorch's fused attention (``--attention-backend auto|flash|fused``) keeps no scores, only its
output, which is the projection's input, and a log-sum-exp of b a s / t values (not counted).
So a block keeps, in bytes::

                         fused attention      explicit attention
    fp32                 4 sbh (16)           4 sbh (16 + as/h)
    autocast fp16/bf16     sbh (36)             sbh (36 + 6 as/h)     (the residual stream stays fp32)

against Korthikanti's sbh (34 + 5as/h), which has half residuals, dropout masks and a half softmax.

**Sequence parallelism** (``--sequence-parallel``, tp > 1) splits what stayed whole along the
sequence: the residual stream (2 sbh, fp32) and the LayerNorm outputs (2 sbh: the column-parallel
GEMM keeps only its T / t shard and gathers it again in backward) become 2 sbh / t each, so every
term is divided by t::

                         fused attention      explicit attention
    fp32                 4 sbh (16) / t       4 sbh (16 + as/h) / t
    autocast fp16/bf16     sbh (36) / t         sbh (36 + 6 as/h) / t

as Korthikanti's sbh (10 + 24/t + 5as/(ht)) with tp alone becomes sbh/t (34 + 5as/h) with SP.
PyTorch's DTensor plan (``--tensor-parallel-impl dtensor``, ``native/dtensor_parallel.py``) gathers the
LayerNorm output once, before qkv and fc1, and autograd keeps that gathered DTensor for their weight
gradients: the 2 sbh of LN outputs stay whole (fp32 with SP at t = 2: 4 sbh (18) against Megatron's
4 sbh (16)), for 2 fewer all-gathers per block in backward. Its embeddings and output layer are
whole on every tp rank (no vocab-parallel split), and so is the loss head.
A checkpointed group's input (full recomputation) and the final LayerNorm's input and output
are T / t of the sequence as well.

**Recomputation** (``transformer/recompute.py``, Megatron's flags), per block and micro-batch::

    none                     the block, as above
    selective                the block less its core attention's scores: 4 sbh (16) in fp32
                             with either backend (fused attention had no scores to drop); one
                             block's scores are rebuilt at a time in backward
    full uniform N           each group of N blocks keeps its input, 4 sbh bytes (fp32); the
                             group being rebuilt in backward holds its N blocks
    full block N             the stage's first N blocks keep their input, 4 sbh bytes each, the
                             other L / pp - N the block as above; one block rebuilt at a time

The loss head keeps the fp32 log-softmax (b s V) and needs two more b s V fp32 tensors in its
backward, which ends before any block is rebuilt: the peak adds the larger of the two.

**Llama's blocks** (``transformer/config.py``): a block holds qkv h (a + 2g) d, proj a d h and
SwiGLU's 3 h F weights, no biases with ``--disable-bias-linear``, one weight per RMSNorm; no
position table with RoPE; the last stage an untied (V / t, h) output layer (:func:`layer_parameters`).

**Mixture of experts** (``--num-experts E``): each block's MLP ((8 h^2 + 4 h) / tp + h on a rank: its
fc2 bias whole) becomes a router (E h) and this rank's E / ep experts, each split over tp as the
MLP (etp = tp): expert parameters, their gradients and optimizer state divide by ep x tp. Activations are counted as the dense MLP's (the k
routed copies of each token are not in the estimate).

**Context parallelism** (``context_parallel/ring_attention.py``): a rank holds s / cp tokens of every sample,
so every activation above counts s / cp instead of s, the loss head included: activation memory
per rank falls as 1 / cp. Ring attention stores no scores (it recomputes them per block in
backward, like fused attention), only q, k, v, its output and a log-sum-exp; the K/V blocks in
flight and one block pair's (b, a/t, s/(2cp), s/(2cp)) scores are transient and not counted.
Gradients are all-reduced over dp x cp through one flat copy.

**Pipelines**: a stage holds L / pp layers; the first stage keeps the activations of
min(pp, M) micro-batches under 1F1B, of all M under GPipe.

**Interleaved 1F1B** (v = ``vp`` chunks of L / (pp v) layers per rank, ``pipeline_parallel/interleaved.py``):
the first stage runs W = 2 (pp - 1) + (v - 1) pp warm-up chunk-forwards, then one more forward
before its first backward, so at its peak it holds min(W + 1, v M) chunk-activations of
L / (pp v) layers each. In units of one micro-batch through the whole stage (L / pp layers)::

    (W + 1) / v = (2 pp - 1 + (v - 1) pp) / v = pp (1 + (pp - 1) / (pp v))

pp micro-batches' activations times (1 + (pp - 1)/(pp v)), Megatron-LM's figure (Narayanan et
al. 2021): interleaving costs the first stage (pp - 1)/v more stage-activations than 1F1B's pp.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.gpt.memory.setup import HALF as _HALF
from distlab.gpt.memory.setup import MemorySetup
from distlab.gpt.transformer.recompute import EXPLICIT_BACKENDS, checkpoint_groups
from distlab.logs.formats import PREDICTION

MiB = 2**20


def num_parameters(L: int, h: int, V: int, s: int) -> int:
    """Parameters of the whole GPT: 12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h)) + 2h (final LN)."""
    return L * (12 * h * h + 13 * h) + (V + s) * h + 2 * h


def layer_parameters(c: MemorySetup) -> tuple[int, int]:
    """One dense block's parameters (split over tp, replicated on every tp rank). GPT-2:
    (12 h^2 + 7 h, 6 h): qkv, proj, fc1, fc2 weights, qkv and fc1 biases; proj and fc2 biases and
    two LayerNorms. Llama: qkv h (a + 2g) d, proj a d h, the MLP 3 h F (SwiGLU), no biases, two
    RMSNorm weights (``transformer/config.py``)."""
    h, a = c.hidden_size, c.num_attention_heads
    d = c.kv_channels or h // a
    g = c.num_query_groups or a
    f = c.ffn_hidden_size or 4 * h
    fc1 = 2 * f if c.swiglu else f  # [gate; up] with SwiGLU
    split = h * (a + 2 * g) * d + a * d * h + h * fc1 + f * h
    replicated = 2 * _norm_parameters(c)
    if c.add_bias_linear:
        split += (a + 2 * g) * d + fc1
        replicated += 2 * h
    return split, replicated


def _norm_parameters(c: MemorySetup) -> int:
    return 2 * c.hidden_size if c.normalization == "LayerNorm" else c.hidden_size


def _mlp_parameters(c: MemorySetup) -> int:
    """One MLP's parameters on a rank, split over tp but for fc2's bias (GPT-2: (8 h^2 + 4 h) / tp + h)."""
    h, f = c.hidden_size, c.ffn_hidden_size or 4 * c.hidden_size
    split = (3 if c.swiglu else 2) * h * f + ((2 * f if c.swiglu else f) if c.add_bias_linear else 0)
    return split // c.tp + (h if c.add_bias_linear else 0)


def stage_parameters(c: MemorySetup) -> int:
    """Parameters on the first pipeline stage's rank (it holds the embeddings): matrices / tp."""
    h = c.hidden_size
    split, replicated = layer_parameters(c)
    layer = split // c.tp + replicated
    if c.num_experts is not None:  # the MLP -> router E h + E / ep experts, each split over tp as the MLP
        layer += c.num_experts * h + (c.num_experts // c.ep - 1) * _mlp_parameters(c)
    vocab = c.vocab_size * h // _vocab_split(c)
    n = (c.num_layers // c.pp) * layer + vocab
    n += c.seq_length * h if c.position_embedding_type == "learned_absolute" else 0
    if c.pp == 1:  # also the last stage: the final norm and an untied output layer
        n += _norm_parameters(c) + (vocab if c.untie_embeddings_and_output_weights else 0)
    return n


def _vocab_split(c: MemorySetup) -> int:
    """Ranks the embedding and the logits are split over: tp (Megatron's vocab-parallel), or 1 (DTensor's plan)."""
    return 1 if c.tensor_parallel_impl == "dtensor" else c.tp


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False
) -> float:
    """Activations of one layer in half precision (Korthikanti et al. 2022, eq. 1, 2 and 4):
    s b h (34 + 5 a s / h) without tp, s b h (10 + 24/t + 5 a s / (h t)) with t-way tp, and
    s b h / t (34 + 5 a s / h) with tp and sequence parallelism."""
    if sequence_parallel:
        return s * b * h / tp * (34 + 5 * a * s / h)
    if tp == 1:
        return s * b * h * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def _local_seq(c: MemorySetup) -> int:
    """Tokens of a sample on this rank: s, or s / cp with context parallelism."""
    return c.seq_length // c.cp


def _sbh(c: MemorySetup) -> int:
    return _local_seq(c) * c.micro_batch_size * c.hidden_size


def _outside_sbh(c: MemorySetup) -> float:
    """s b h values of a tensor outside the tp GEMMs on one rank: / t with sequence parallelism."""
    return _sbh(c) / c.tp if c.sequence_parallel else _sbh(c)


def scores_bytes(c: MemorySetup) -> float:
    """The softmax probabilities the explicit attention keeps, b (a / t) s^2 values: fp32, plus
    their half copy under autocast; 0 with fused attention and with ring attention (cp > 1)."""
    if c.attention_backend not in EXPLICIT_BACKENDS or c.cp > 1:
        return 0.0
    per_value = 4 + (2 if c.precision in _HALF else 0)
    return per_value * c.micro_batch_size * c.num_attention_heads * c.seq_length**2 / c.tp


def split_activations(c: MemorySetup) -> float:
    """The values of one block split by tp, in units of s b h (GPT-2: 12): q, K and V as the core
    attention keeps them (fused attention: g K/V heads; explicit and ring attention: repeated to a),
    its output (the projection's input), and the MLP's: GeLU's input and output (2 F), or SwiGLU's
    gate, up, silu(gate) and their product (4 F)."""
    h, a = c.hidden_size, c.num_attention_heads
    d, f = c.kv_channels or h // a, c.ffn_hidden_size or 4 * h
    grouped = c.attention_backend not in EXPLICIT_BACKENDS and c.cp == 1
    g = (c.num_query_groups or a) if grouped else a
    return (2 * a * d + 2 * g * d + (4 if c.swiglu else 2) * f) / h


def block_bytes(c: MemorySetup) -> float:
    """One block's stored activations without recomputation (see the module docstring)."""
    per_value = 2 if c.precision in _HALF else 4
    # fp32 LN inputs; LN outputs (/ t with Megatron's SP); split by tp
    residual, whole, split = 2, 2, split_activations(c)
    # DTensor's plan keeps the LN outputs gathered for qkv's and fc1's weight gradients
    ln_out = _sbh(c) if c.tensor_parallel_impl == "dtensor" else _outside_sbh(c)
    outside = _outside_sbh(c) * 4 * (residual + 2 * _rms_extra(c)) + ln_out * per_value * whole
    return outside + _sbh(c) * per_value * split / c.tp + scores_bytes(c)


def _rms_extra(c: MemorySetup) -> int:
    """s b h per norm PyTorch's ``F.rms_norm`` keeps besides its input, in fp32 under autocast too:
    its normalised input x / rms(x), for the weight's gradient (LayerNorm's fused kernel keeps
    only the input, its mean and 1 / std)."""
    return 1 if c.normalization == "RMSNorm" else 0


def _groups(c: MemorySetup) -> list[tuple[int, int, bool]]:
    n = c.num_layers // (c.pp * c.vp)  # recomputation groups are per model chunk
    return checkpoint_groups(n, c.recompute_granularity, c.recompute_method, c.recompute_num_layers)


def chunk_layers_bytes(c: MemorySetup) -> float:
    """One model chunk's (L / (pp v) blocks) stored activations for one micro-batch, by
    recomputation mode; with v = 1 the chunk is the stage."""
    if c.recompute_granularity == "selective":
        return (c.num_layers // (c.pp * c.vp)) * (block_bytes(c) - scores_bytes(c))
    kept = [
        4 * _outside_sbh(c) if ckpt else (end - first) * block_bytes(c) for first, end, ckpt in _groups(c)
    ]
    return sum(kept)  # a checkpointed group keeps its fp32 input only


def stage_layers_bytes(c: MemorySetup) -> float:
    """The stage's blocks' (all its chunks') stored activations for one micro-batch."""
    return c.vp * chunk_layers_bytes(c)


def chunks_in_flight(c: MemorySetup) -> int:
    """Chunk-forwards (micro-batch, chunk) whose activations the first stage holds at its peak:
    1 without a pipeline, M under GPipe, min(pp, M) under 1F1B, min(W + 1, v M) interleaved."""
    m = c.num_micro_batches
    if c.pp == 1:
        return 1
    if c.pipeline_schedule == "gpipe":
        return m
    if c.vp == 1:
        return min(c.pp, m)
    warmup = 2 * (c.pp - 1) + (c.vp - 1) * c.pp
    return min(warmup + 1, c.vp * m)


def recompute_extra_bytes(c: MemorySetup) -> float:
    """What backward rebuilds at once: the largest checkpointed group's blocks less its stored
    input (full), one block's scores (selective), nothing without recomputation."""
    if c.recompute_granularity == "selective":
        return scores_bytes(c)
    rebuilt = [end - first for first, end, ckpt in _groups(c) if ckpt]
    return max(rebuilt) * block_bytes(c) - 4 * _outside_sbh(c) if rebuilt else 0.0


def head_bytes(c: MemorySetup) -> float:
    """Loss head: final LN in/out (2 sbh fp32, / t with SP) and three b s V fp32 tensors at its backward."""
    bsv = c.micro_batch_size * _local_seq(c) * c.vocab_size / _vocab_split(c)
    ln_f = _sbh(c) if c.tensor_parallel_impl == "dtensor" else _outside_sbh(c)  # DTensor gathers before ln_f
    return 4 * ((2 + _rms_extra(c)) * ln_f + 3 * bsv)


def activation_bytes(c: MemorySetup) -> float:
    """Peak activations on the first stage (with pp = 1 also the last: it adds the head)."""
    layers = chunk_layers_bytes(c) * chunks_in_flight(c)
    head = head_bytes(c) if c.pp == 1 else 0.0
    return layers + max(head, recompute_extra_bytes(c))  # the head's backward ends before a rebuild


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes on one rank, by kind, and the peak they add up to."""

    parameters: float
    gradients: float
    optimizer_state: float
    half_weight_copies: float
    """Weights alive only for compute: autocast's half copies, or FSDP2's gathered parameters."""
    activations: float

    def peak(self, first_iteration: bool = False, accumulating: bool = False) -> float:
        """max(forward/backward, optimizer step). The step holds every model state; in
        forward/backward the optimizer state exists from the second iteration on, gradients
        from the second micro-batch on (accumulation) and not at all before the first."""
        step = self.parameters + self.gradients + self.optimizer_state
        fwd_bwd = self.parameters + self.half_weight_copies + self.activations
        fwd_bwd += 0 if first_iteration else self.optimizer_state
        fwd_bwd += self.gradients if accumulating else 0
        return max(step, fwd_bwd)


def _zero_shards(c: MemorySetup, stage: int) -> int:
    """Ranks a model state is split over: dp from the ZeRO stage that shards it on, else 1."""
    return c.dp if c.zero_stage >= stage else 1


def fsdp2_gathered_bytes(c: MemorySetup) -> float:
    """FSDP2's unsharded parameters during compute, in the parameters' dtype (bf16 with --bf16):
    the root (embeddings, final LayerNorm: never resharded) and one block, or with
    ``reshard_after_forward`` False every block (gathered once, kept to backward)."""
    block = sum(layer_parameters(c))
    root = stage_parameters(c) - c.num_layers * block
    blocks = c.num_layers if not c.fsdp2_reshard_after_forward else 1
    return (root + blocks * block) * (2 if c.precision in _HALF else 4)


def estimate(c: MemorySetup) -> MemoryEstimate:
    """Model states (per precision mode, ZeRO stage, offload) and activations of one rank."""
    n = stage_parameters(c)
    if c.fsdp2:  # fp32 states sharded over dp; bf16 compute through MixedPrecisionPolicy, no autocast
        shards = 0.0 if c.offload else n * 16 / c.dp  # parameters 4 + gradients 4 + Adam 8, / dp
        return MemoryEstimate(shards * 4 / 16, shards * 4 / 16, shards * 8 / 16, fsdp2_gathered_bytes(c),
                              activation_bytes(c))  # fmt: skip
    if c.distributed_optimizer:
        return _distributed_optimizer_estimate(c, n)
    deepspeed_mixed = c.zero_stage > 0 and c.precision in _HALF
    p_bytes, g_bytes, k = (2, 2, 12) if deepspeed_mixed else (4, 4, 8)
    params = n * p_bytes / _zero_shards(c, 3)
    grads = n * g_bytes / _zero_shards(c, 2)
    optim = 0.0 if c.offload else n * k / _zero_shards(c, 1)
    if c.offload and c.zero_stage == 3:
        params = 0.0
    if c.zero_stage == 0 and c.dp * c.cp > 1:
        grads *= 2  # the all-reduce's flat buffer (DDP's buckets) holds a second copy of the gradients
    copies = 2 * n if c.precision in _HALF and not deepspeed_mixed else 0.0
    return MemoryEstimate(params, grads, optim, copies, activation_bytes(c))


def _distributed_optimizer_estimate(c: MemorySetup, n: int) -> MemoryEstimate:
    """``--use-distributed-optimizer`` (``distributed/distrib_optimizer.py``): parameters in the
    run's dtype and the gradient buffer whole, the fp32 copies and moments over d = dp x cp::

        fp32                      4 + 4 + 8 / d                 =  8 +  8 / d
        bf16                      2 + 4 + (4 main + 8) / d      =  6 + 12 / d
        bf16, bf16 gradients      2 + 2 + (4 + 4 + 8) / d       =  4 + 16 / d

    (the padding of each bucket to a multiple of d, under d elements, is left out). The weights
    are bf16 already: autocast makes no half copies. Activations are counted as under autocast
    over fp32 weights (the residual stream in fp32), an upper bound for bf16 weights."""
    d, half = c.dp * c.cp, c.precision in _HALF
    g_bytes = 2 if c.grad_reduce_in_bf16 else 4
    k = 8 + (4 if half else 0) + (4 if g_bytes == 2 else 0)
    return MemoryEstimate(n * (2 if half else 4), n * g_bytes, n * k / d, 0.0, activation_bytes(c))


def format_prediction(predicted: float, measured: float, how: str) -> str:
    """The line printed after the first iteration: predicted vs measured bytes, in MiB
    (``distlab.logs.formats.PREDICTION``)."""
    error = 100.0 * (measured - predicted) / predicted
    return PREDICTION.format(predicted=predicted / MiB, measured=measured / MiB, how=how, error=error)
