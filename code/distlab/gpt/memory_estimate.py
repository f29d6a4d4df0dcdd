"""Predict a rank's peak memory before running: model states plus activations.

Notation: L layers, h hidden, a heads, s sequence, b micro batch, V padded vocabulary,
P parameters on this rank, tp / pp / dp the parallel sizes, M micro-batches per step.

**Model states** (bytes per parameter; ZeRO, Rajbhandari et al. 2020, with K the optimizer's)::

    precision              parameters  gradients  optimizer (Adam)
    fp32                   4           4          8   (exp_avg + exp_avg_sq)
    mixed (Megatron / DS)  2           2          12  (fp32 master + exp_avg + exp_avg_sq)
    this engine, fp16/bf16 4 (+2)      4          8   (fp32 weights; autocast's half copies
                                                       of the weights live through fwd/bwd)

ZeRO stage 1 divides the optimizer state by dp, stage 2 also the gradients, stage 3 also the
parameters; offload moves the optimizer state (stage 3: also the parameters) to the CPU.

**Activations per layer** (Korthikanti et al. 2022) in half precision, with dropout and the
attention scores stored::

    s b h (34 + 5 a s / h) bytes  = attention 11 sbh + 5 a s^2 b, MLP 19 sbh, 2 LayerNorms 4 sbh

This course's GPT has no dropout masks (dropout 0) and uses fused (flash) attention, which keeps
its output instead of the s x s scores, so one block stores, in units of s b h values::

    LN1 input 1, qkv input 1, q k v 3, attention output 1, proj input 1,
    LN2 input 1, fc1 input 1, GeLU input 4, fc2 input 4           = 17 (13 of them split by tp)

all fp32 in fp32 (68 sbh bytes); under autocast the two LayerNorm inputs (the residual stream)
stay fp32 and the other 15 are half (38 sbh bytes). With ``--recompute-activations`` a block
keeps only its input (4 sbh bytes) and one block is rebuilt at a time in backward. The loss
head keeps the fp32 log-softmax (b s V) and needs two more b s V fp32 tensors in its backward.

**Pipelines**: a stage holds L / pp layers; the first stage keeps the activations of
min(pp, M) micro-batches under 1F1B, of all M under GPipe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MiB = 2**20
_HALF = ("fp16", "bf16")


@dataclass(frozen=True)
class MemorySetup:
    """A model shape and how it is trained: everything the estimate depends on."""

    num_layers: int
    """L, blocks in the whole model."""
    hidden_size: int
    """h."""
    num_attention_heads: int
    """a."""
    seq_length: int
    """s."""
    vocab_size: int
    """V, the padded vocabulary."""
    micro_batch_size: int
    """b."""
    precision: str = "fp32"
    """fp32, fp16 or bf16 (autocast over fp32 weights, as ``pretrain_gpt.py`` runs)."""
    recompute_activations: bool = False
    num_micro_batches: int = 1
    """M, gradient-accumulation steps (micro-batches per step on this rank)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    pipeline_schedule: str = "1f1b"
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (0: plain data parallelism, DDP)."""
    offload: bool = False
    """DeepSpeed offload of the optimizer state (stage 3: and parameters) to the CPU."""

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", *_HALF):
            raise ValueError(f"precision {self.precision!r} must be fp32, fp16 or bf16")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero stage {self.zero_stage} must be 0, 1, 2 or 3")
        if self.num_layers % self.pp or self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"layers {self.num_layers} must divide by pp {self.pp} and hidden {self.hidden_size} "
                f"by heads {self.num_attention_heads}"
            )


def num_parameters(L: int, h: int, V: int, s: int) -> int:
    """Parameters of the whole GPT: 12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h)) + 2h (final LN)."""
    return L * (12 * h * h + 13 * h) + (V + s) * h + 2 * h


def stage_parameters(c: MemorySetup) -> int:
    """Parameters on the first pipeline stage's rank (it holds the embeddings): matrices / tp."""
    h = c.hidden_size
    split = 12 * h * h + 7 * h  # qkv, proj, fc1, fc2 weights; qkv (3h) and fc1 (4h) biases
    layer = split // c.tp + 6 * h  # + two LayerNorms (4h), proj and fc2 biases (2h), replicated
    n = (c.num_layers // c.pp) * layer + c.vocab_size * h // c.tp + c.seq_length * h
    return n + (2 * h if c.pp == 1 else 0)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, tp: int = 1) -> float:
    """Activations of one layer in half precision (Korthikanti et al. 2022, eq. 1 and 2):
    s b h (34 + 5 a s / h) without tp, s b h (10 + 24/t + 5 a s / (h t)) with t-way tp."""
    if tp == 1:
        return s * b * h * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def layer_activation_bytes(c: MemorySetup) -> float:
    """One block's stored activations in this course's GPT (see the module docstring)."""
    sbh = c.seq_length * c.micro_batch_size * c.hidden_size
    if c.recompute_activations:
        return 4 * sbh  # the block's fp32 input only
    half = c.precision in _HALF
    residual, other = 2, 15  # residual-stream values (LN inputs), the rest
    split = 13  # q k v, attention output, proj input, GeLU and fc2 inputs are split by tp
    kept_whole = other - split
    per_value = 2 if half else 4
    return sbh * (4 * residual + per_value * (kept_whole + split / c.tp))


def recompute_extra_bytes(c: MemorySetup) -> float:
    """With recomputation, the one block rebuilt in backward holds its full activations."""
    if not c.recompute_activations:
        return 0.0
    full = MemorySetup(**{**c.__dict__, "recompute_activations": False})
    return layer_activation_bytes(full)


def head_bytes(c: MemorySetup) -> float:
    """Loss head: final LN in/out (2 sbh fp32) and three b s V fp32 tensors at its backward."""
    sbh = c.seq_length * c.micro_batch_size * c.hidden_size
    bsv = c.micro_batch_size * c.seq_length * c.vocab_size / c.tp
    return 4 * (2 * sbh + 3 * bsv)


def activation_bytes(c: MemorySetup) -> float:
    """Peak activations on the first stage (with pp = 1 also the last: it adds the head)."""
    alive = 1
    if c.pp > 1:
        alive = min(c.pp, c.num_micro_batches) if c.pipeline_schedule == "1f1b" else c.num_micro_batches
    layers = (c.num_layers // c.pp) * layer_activation_bytes(c) * alive
    head = head_bytes(c) if c.pp == 1 else 0.0
    return layers + max(head, recompute_extra_bytes(c))  # the head's backward ends before a rebuild


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes on one rank, by kind, and the peak they add up to."""

    parameters: float
    gradients: float
    optimizer_state: float
    half_weight_copies: float
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


def estimate(c: MemorySetup) -> MemoryEstimate:
    """Model states (per precision mode, ZeRO stage, offload) and activations of one rank."""
    n = stage_parameters(c)
    deepspeed_mixed = c.zero_stage > 0 and c.precision in _HALF
    p_bytes, g_bytes, k = (2, 2, 12) if deepspeed_mixed else (4, 4, 8)
    params = n * p_bytes / _zero_shards(c, 3)
    grads = n * g_bytes / _zero_shards(c, 2)
    optim = 0.0 if c.offload else n * k / _zero_shards(c, 1)
    if c.offload and c.zero_stage == 3:
        params = 0.0
    if c.zero_stage == 0 and c.dp > 1:
        grads *= 2  # DDP's all-reduce buckets hold a second copy of the gradients
    copies = 2 * n if c.precision in _HALF and not deepspeed_mixed else 0.0
    return MemoryEstimate(params, grads, optim, copies, activation_bytes(c))


def format_prediction(predicted: float, measured: float, how: str) -> str:
    """The line printed after the first iteration: predicted vs measured, in MiB."""
    error = 100.0 * (measured - predicted) / predicted
    return (
        f"> memory: predicted peak {predicted / MiB:.1f} MiB | measured {measured / MiB:.1f} MiB "
        f"({how}) | error {error:+.1f}%"
    )


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_cpu_peak() -> int:
    """Reset the kernel's peak-RSS mark of this process (``clear_refs`` 5); return RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return 1024 * _status_kib("VmRSS")


def cpu_peak_since(baseline: int) -> int:
    """Peak RSS (``VmHWM``) above ``baseline`` bytes, since the last :func:`reset_cpu_peak`."""
    return 1024 * _status_kib("VmHWM") - baseline
