"""Predict a rank's peak memory before running: model states plus activations.

Notation: L layers, h hidden, a heads, s sequence, b micro batch, V padded vocabulary,
P parameters on this rank, tp / pp / dp / cp the parallel sizes, M micro-batches per step.

**Model states** (bytes per parameter, K the optimizer's; the optimizer step updates in place,
as ``build_optimizer``'s fused AdamW does: torch's foreach AdamW adds a 4-byte temporary per
parameter, sqrt(exp_avg_sq), 20 bytes at the step instead of 16)::

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
engine's distributed optimizer keeps half parameters under --bf16 / --fp16, as Megatron does:
8 + 8/d (fp32), 6 + 12/d (bf16), 4 + 16/d (fp16, and bf16 with --grad-reduce-in-bf16), d = dp x cp.
ZeRO stages 1, 2, 3 divide by dp the optimizer state, + the gradients, + the parameters; offload
moves the optimizer state (stage 3: also the parameters) to the CPU.

**Activations per layer** (Korthikanti et al. 2022) in half precision, with dropout and the
attention scores stored::

    s b h (34 + 5 a s / h) bytes  = attention 11 sbh + 5 a s^2 b, MLP 19 sbh, 2 LayerNorms 4 sbh

No dropout masks (the course's runs pass dropout 0; Megatron's 0.1 adds them). Per s b h value (t = tp), a block keeps::

    residual stream (LN1, LN2 inputs), training dtype (--fp32-residual-connection: fp32)   2
    LN1 and LN2 outputs (qkv and fc1 inputs), whole on every tp rank           2
    q k v 3, attention output = proj input 1, GeLU input 4, fc2 input 4       12 / t
      (Llama: q and output 2 a d / h, K/V 2 g d / h (fused attention keeps the g
      grouped heads), SwiGLU's gate, up, silu(gate), product 4 F / h; each RMSNorm keeps 2
      fp32 values for its 1 input, an fp32 copy and x / rms(x): ``norm_input_bytes``)
    --attention-backend unfused|local only: the softmax probabilities,
      a s / h (the b a s^2 / t scores), fp32 and, under autocast, a half copy   a s / (h t)

PyTorch's fused attention (``--attention-backend auto|flash|fused``) keeps no scores, only its output
(the projection's input) and a log-sum-exp of b a s / t values (not counted). A block keeps, in bytes::

                                   fused attention      explicit attention
    fp32                           4 sbh (16)           4 sbh (16 + as/h)
    autocast fp16/bf16               sbh (32)             sbh (32 + 6 as/h)
      --fp32-residual-connection     sbh (36)             sbh (36 + 6 as/h)

against Korthikanti's sbh (34 + 5as/h): half residuals too, dropout masks (2 sbh), a half softmax.

**Sequence parallelism** (``--sequence-parallel``, tp > 1) splits what stayed whole along the
sequence: the residual stream (2 sbh) and the LayerNorm outputs (2 sbh: the column-parallel
GEMM keeps only its T / t shard and gathers it again in backward) become 2 sbh / t each, so every
term is divided by t::

                                   fused attention      explicit attention
    fp32                           4 sbh (16) / t       4 sbh (16 + as/h) / t
    autocast fp16/bf16               sbh (32) / t         sbh (32 + 6 as/h) / t   (36 with the flag)

as Korthikanti's sbh (10 + 24/t + 5as/(ht)) with tp alone becomes sbh/t (34 + 5as/h) with SP.
PyTorch's DTensor plan (``--tensor-parallel-impl dtensor``, ``native/dtensor_parallel.py``) gathers the
LayerNorm output once, before qkv and fc1, and autograd keeps that gathered DTensor for their weight
gradients: the 2 sbh of LN outputs stay whole (fp32 with SP at t = 2: 4 sbh (18) against Megatron's
4 sbh (16)), for 2 fewer all-gathers per block in backward. Its embeddings and output layer are
whole on every tp rank (no vocab-parallel split), and so is the loss head.
A checkpointed group's input (full recomputation) and the final LayerNorm's input and output
are T / t of the sequence as well.

**Recomputation** (``transformer/recompute.py``, Megatron's flags), what a block keeps per
micro-batch::

    none                     the block, as above
    selective                the block less its core attention's scores: 4 sbh (16) in fp32
                             with either backend (fused attention had no scores to drop)
    full uniform N           each group of N blocks keeps its input, r sbh bytes (``residual_bytes``)
    full block N             the stage's first N blocks keep their input, r sbh bytes each, the
                             other L / pp - N the block as above

**The peak is in backward** (``backward_moments``), at the largest of these moments::

    head      everything kept + the loss head (its fp32 log-softmax and two more b s V fp32
              tensors in its backward) + the head's parameter gradients
    unit u    what the units before u keep + W_u + the gradients made so far (those of the
              head and of the blocks from u's last on, at 4 bytes / parameter)

A unit is a checkpointed group or a single block, taken by backward in reverse order. ``W_u``,
through u's last block, is the larger of (sbh in bytes, p = 2 under autocast, 4 in fp32; n the
bytes a norm keeps of its input)::

    MLP       K + r sbh + p sbh (1 + 4 / t)
    softmax   K + r sbh - (n + p (1 + 9 / t)) sbh + 12 b (a/t) s^2 - (scores kept)

``K`` the unit's blocks' activations (a checkpointed group's, rebuilt whole: its N blocks, of
which the first block's input is the one it kept; selective: the block without its scores),
``r sbh`` the residual stream's gradient, ``p sbh (1 + 4/t)`` fc2's output gradient and
GeLU's (b, s, 4h / t) in the MLP's backward; at the explicit attention's softmax the block's
second half is freed (what LN2 keeps of its input, its output, the projection's, GeLU's and fc2's
inputs) and the softmax backward holds the fp32 probabilities, their gradient and the scores' gradient,
``12 b (a/t) s^2`` bytes, of which the block kept ``scores`` (4 or 6, none under selective:
there the rebuild adds all 12). Without recomputation the head's moment is the peak; with full
recomputation a rebuilt group holds whole blocks again while the gradients made so far grow
to all of them (the first group: every gradient and one rebuilt group, next to Adam's state after
the first iteration). Autocast's half copies of a checkpointed group's weights live only while
it is rebuilt: the estimate keeps the copies of the non-checkpointed blocks and of the largest
group (``rebuilt_parameters``). The CPU meter's first-iteration peak (4 layers, h 64-256, s 512,
bf16, the residual stream bf16 or fp32, every recomputation mode) is 0.4 % to 4.0 % above the
estimate, a ``pretrain`` run's 1.0 % (``tests/test_gpt_memory_driver.py``).

**Llama's blocks** (``transformer/config.py``): a block holds qkv h (a + 2g) d, proj a d h and
SwiGLU's 3 h F weights, no biases with ``--disable-bias-linear``, one weight per RMSNorm; no
position table with RoPE; the last stage an untied (V / t, h) output layer (``parameters.layer_parameters``).

**Mixture of experts** (``--num-experts E``): each block's MLP ((8 h^2 + 4 h) / tp + h on a rank: its
fc2 bias whole) becomes a router (E h) and this rank's E / ep experts, each split over tp as the
MLP (etp = tp): expert parameters, their gradients and optimizer state divide by ep x tp. Activations are counted as the dense MLP's (the k
routed copies of each token are not in the estimate).

**Context parallelism** (``context_parallel/ring_attention.py``): a rank holds s / cp tokens of every sample,
so every activation above counts s / cp instead of s (s / (cp t) outside the tp GEMMs with SP), the
loss head included: activation memory per rank falls as 1 / cp. Ring attention stores no scores (it
recomputes them per block in backward, like fused attention), only q, k, v, its output and a
log-sum-exp; the K/V blocks in flight and one block pair's (b, a/t, s/(2cp), s/(2cp)) scores are transient.
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

from distlab.gpt.memory import parameters as rank_parameters
from distlab.gpt.memory.parameters import block_parameters, layer_parameters, stage_parameters, vocab_split
from distlab.gpt.memory.setup import HALF as _HALF
from distlab.gpt.memory.setup import MemorySetup
from distlab.gpt.transformer.recompute import EXPLICIT_BACKENDS, checkpoint_groups

MiB = 2**20


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
    # what the 2 norms keep of their inputs (/ t with Megatron's SP); their outputs; split by tp
    norms, whole, split = 2 * norm_input_bytes(c), 2, split_activations(c)
    # DTensor's plan keeps the LN outputs gathered for qkv's and fc1's weight gradients
    ln_out = _sbh(c) if c.tensor_parallel_impl == "dtensor" else _outside_sbh(c)
    outside = _outside_sbh(c) * norms + ln_out * per_value * whole
    return outside + _sbh(c) * per_value * split / c.tp + scores_bytes(c)


def residual_bytes(c: MemorySetup) -> int:
    """Bytes per residual stream value: 2 in fp16 / bf16, 4 in fp32 or with fp32_residual_connection."""
    return 2 if c.precision in _HALF and not c.fp32_residual_connection else 4


def norm_input_bytes(c: MemorySetup) -> int:
    """Bytes per (b, s, h) value a norm keeps of its input for backward (``transformer/norms.py``):
    LayerNorm the input, in the residual stream's dtype; RMSNorm (``F.rms_norm`` on the CPU) an fp32
    copy of it and the fp32 x / rms(x) for the weight's gradient, whatever the residual's dtype."""
    return 8 if c.normalization == "RMSNorm" else residual_bytes(c)


def _groups(c: MemorySetup) -> list[tuple[int, int, bool]]:
    n = c.num_layers // (c.pp * c.vp)  # recomputation groups are per model chunk
    return checkpoint_groups(n, c.recompute_granularity, c.recompute_method, c.recompute_num_layers)


def chunk_layers_bytes(c: MemorySetup) -> float:
    """One model chunk's (L / (pp v) blocks) stored activations for one micro-batch, by
    recomputation mode; with v = 1 the chunk is the stage."""
    if c.recompute_granularity == "selective":
        return (c.num_layers // (c.pp * c.vp)) * (block_bytes(c) - scores_bytes(c))
    group_input = residual_bytes(c) * _outside_sbh(c)  # all a checkpointed group keeps
    return sum(group_input if ckpt else (end - first) * block_bytes(c) for first, end, ckpt in _groups(c))


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


def head_bytes(c: MemorySetup) -> float:
    """Loss head: what the final norm keeps of its input and its output (the compute dtype), s b h
    each (/ t with SP); three b s V fp32 tensors at its backward."""
    per_value = 2 if c.precision in _HALF else 4
    bsv = c.micro_batch_size * _local_seq(c) * c.vocab_size / vocab_split(c)
    ln_f = _sbh(c) if c.tensor_parallel_impl == "dtensor" else _outside_sbh(c)  # DTensor gathers before ln_f
    return (norm_input_bytes(c) + per_value) * ln_f + 4 * 3 * bsv


def attention_backward_bytes(c: MemorySetup) -> float:
    """What the explicit attention's backward holds at its softmax, fp32 and autocast alike: the
    fp32 probabilities, their gradient (cast up from the half product's) and the scores' gradient,
    ``12 b (a / t) s^2`` bytes; 0 with fused attention and with ring attention (cp > 1)."""
    if scores_bytes(c) == 0:
        return 0.0
    return 12 * c.micro_batch_size * c.num_attention_heads * c.seq_length**2 / c.tp


def _units(c: MemorySetup) -> list[tuple[int, int, bool]]:
    """What backward takes at once, in forward order: each checkpointed group, every other block."""
    units = []
    for first, end, ckpt in _groups(c):
        units += [(first, end, True)] if ckpt else [(i, i + 1, False) for i in range(first, end)]
    return units


def _unit_stored(c: MemorySetup, first: int, end: int, ckpt: bool) -> float:
    """Bytes a unit keeps from its forward to its backward (``chunk_layers_bytes``' terms)."""
    if ckpt:
        return residual_bytes(c) * _outside_sbh(c)  # the group's input
    kept = block_bytes(c) - (scores_bytes(c) if c.recompute_granularity == "selective" else 0.0)
    return (end - first) * kept


def _mlp_side_bytes(c: MemorySetup) -> float:
    """What a block keeps for its second half, freed by the time backward reaches its attention:
    what LN2 keeps of its input, its output, the projection's input, GeLU's and fc2's inputs."""
    per_value = 2 if c.precision in _HALF else 4
    ln_out = _sbh(c) if c.tensor_parallel_impl == "dtensor" else _outside_sbh(c)
    return norm_input_bytes(c) * _outside_sbh(c) + per_value * (ln_out + 9 * _sbh(c) / c.tp)


def _unit_backward(c: MemorySetup, first: int, end: int, ckpt: bool) -> float:
    """Bytes a unit holds at the peak of its backward, through its last block, the larger of::

        MLP       K + R + (s b h + 4 s b h / t) x half-or-fp32 bytes
        softmax   K + R - (MLP side) + (12 b (a/t) s^2 - scores kept)    explicit attention only

    ``K`` its blocks' activations (a checkpointed group's rebuilt, whose first input is the one
    it kept; selective: without the scores), ``R`` = r s b h the residual stream's gradient
    (``residual_bytes``). The MLP's backward adds fc2's output gradient (b, s, h) and GeLU's
    (b, s, 4h / t) beside fc2's input; at the attention's softmax the block's second half is freed
    (``_mlp_side_bytes``) and the attention's backward holds ``attention_backward_bytes`` (the
    rebuilt scores under selective recomputation: the whole 12 b (a/t) s^2)."""
    per_value = 2 if c.precision in _HALF else 4
    kept = (end - first) * block_bytes(c) if ckpt else _unit_stored(c, first, end, ckpt)
    held = kept + residual_bytes(c) * _outside_sbh(c)
    mlp = held + per_value * (_outside_sbh(c) + 4 * _sbh(c) / c.tp)
    if attention_backward_bytes(c) == 0:
        return mlp
    scores_kept = scores_bytes(c) if ckpt or c.recompute_granularity != "selective" else 0.0
    return max(mlp, held - _mlp_side_bytes(c) + attention_backward_bytes(c) - scores_kept)


def backward_moments(c: MemorySetup, grad_bytes: float = 4.0) -> list[tuple[float, float]]:
    """``(activations, gradients)`` bytes on the first stage at each peak of a micro-batch's
    backward, gradients made by then counted at ``grad_bytes`` per parameter (4: fp32)::

        head (pp = 1)   F layers + head                   the loss head's parameters
        unit u          (F - 1) chunk + kept(< u) + W_u   the head's, and of u's last block on

    ``F`` the chunk-forwards in flight (``chunks_in_flight``), ``chunk`` one chunk's kept
    activations (``chunk_layers_bytes``), ``kept(< u)`` what the units before ``u`` keep of this
    micro-batch, ``W_u`` what unit ``u``'s backward holds (``_unit_backward``). A unit is a
    checkpointed group or a block; the gradients of its last block count from its backward on. Without
    recomputation the head's moment is the peak (a block's backward frees more than it makes);
    with it, a rebuilt group holds a whole block (or N) again next to the gradients made so far,
    which, for the first groups, are nearly all of them.
    """
    chunk, flight = chunk_layers_bytes(c), chunks_in_flight(c)
    head_params = stage_parameters(c) - (c.num_layers // c.pp) * block_parameters(c) if c.pp == 1 else 0
    moments = [(flight * chunk + head_bytes(c), grad_bytes * head_params)] if c.pp == 1 else []
    units, kept_before = _units(c), 0.0
    blocks = c.num_layers // (c.pp * c.vp)
    for first, end, ckpt in units:
        made = head_params + (blocks - end + 1) * block_parameters(c)  # through its last block
        acts = (flight - 1) * chunk + kept_before + _unit_backward(c, first, end, ckpt)
        moments.append((acts, grad_bytes * made))
        kept_before += _unit_stored(c, first, end, ckpt)
    return moments


def activation_bytes(c: MemorySetup) -> float:
    """Peak activations on the first stage (with pp = 1 also the last: it adds the head), the
    largest of :func:`backward_moments`."""
    return max(acts for acts, _ in backward_moments(c))


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes on one rank, by kind, and the peak they add up to."""

    parameters: float
    gradients: float
    optimizer_state: float
    half_weight_copies: float
    """Weights alive only for compute: autocast's half copies, or FSDP2's gathered parameters."""
    activations: float
    activations_and_gradients: float
    """The largest sum of activations and the gradients made by then (``backward_moments``)."""

    def peak(self, first_iteration: bool = False, accumulating: bool = False) -> float:
        """max(forward/backward, optimizer step). The step holds every model state (a fused
        optimizer updates in place); in forward/backward the optimizer state exists from the
        second iteration on, all gradients from the second micro-batch on (accumulation), and in
        a micro-batch's backward those made so far."""
        step = self.parameters + self.gradients + self.optimizer_state
        fwd_bwd = self.parameters + self.half_weight_copies
        fwd_bwd += 0 if first_iteration else self.optimizer_state
        fwd_bwd += self.gradients + self.activations if accumulating else self.activations_and_gradients
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
                              activation_bytes(c), _with_gradients(c, 0.0 if c.offload else 4 / c.dp))  # fmt: skip
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
    copies = 2 * (n - rebuilt_parameters(c)) if c.precision in _HALF and not deepspeed_mixed else 0.0
    in_backward = _with_gradients(c, g_bytes / _zero_shards(c, 2))  # the flat buffer comes after backward
    return MemoryEstimate(params, grads, optim, copies, activation_bytes(c), in_backward)


def rebuilt_parameters(c: MemorySetup) -> int:
    """Parameters whose autocast copies are not alive through backward: a checkpointed group's
    forward keeps none (autocast's cache ends with the forward), its rebuild makes them again for
    that group only; so all checkpointed blocks' but the largest group's (per model chunk)."""
    groups = [end - first for first, end, ckpt in _groups(c) if ckpt]
    return c.vp * (sum(groups) - max(groups, default=0)) * block_parameters(c)


def _with_gradients(c: MemorySetup, grad_bytes: float) -> float:
    return max(acts + grads for acts, grads in backward_moments(c, grad_bytes))


def _distributed_optimizer_estimate(c: MemorySetup, n: int) -> MemoryEstimate:
    """``--use-distributed-optimizer`` (``optimizer/distrib_optimizer.py``): parameters in the
    run's dtype and the gradient buffer whole, the fp32 copies and moments over d = dp x cp::

        fp32                      4 + 4 + 8 / d                 =  8 +  8 / d
        bf16                      2 + 4 + (4 main + 8) / d      =  6 + 12 / d
        bf16, bf16 gradients      2 + 2 + (4 + 4 + 8) / d       =  4 + 16 / d
        fp16 (fp16 gradients)     2 + 2 + (4 + 4 + 8) / d       =  4 + 16 / d

    (bucket padding, under d elements each, left out; the experts' d is dp x cp / ep). Weights half
    already: no autocast copies; activations as under autocast over fp32 weights (the same dtypes:
    the residual stream half, or fp32 with --fp32-residual-connection)."""
    d, half = c.dp * c.cp, c.precision in _HALF
    g_bytes = 2 if c.grad_reduce_in_bf16 or c.precision == "fp16" else 4
    k = 8 + (4 if half else 0) + (4 if g_bytes == 2 else 0)
    sharded = (n + (c.ep - 1) * rank_parameters.expert_parameters(c)) * k / d  # experts: ep x fewer ranks
    return MemoryEstimate(
        n * (2 if half else 4), n * g_bytes, sharded, 0.0, activation_bytes(c), _with_gradients(c, g_bytes)
    )
