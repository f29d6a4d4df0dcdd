"""Model FLOPs of one iteration, TFLOP/s and model FLOPs utilisation (MFU).

Megatron's formula (Narayanan et al. 2021, appendix) counts the matrix multiplications of one
global batch of ``B`` samples of length ``s``, ``l`` layers, width ``h``, vocabulary ``V``. One
layer's forward is 24 B s h^2 (QKV, projection, the two MLP GEMMs: 2 FLOPs per multiply-add) plus
4 B s^2 h (Q K^T and the scores times V), the logit layer's 2 B s h V; backward costs two forwards.
Without recomputation::

    F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))

With full recomputation every block runs its forward a second time, the logit layer does not
(it is never recomputed), which gives the paper's ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``.
Both are ``24 B s h^2 (1 + s/(6h)) (3 l + r) + 6 B s h V`` with ``r`` recomputed blocks
(:func:`model_flops_per_iteration`); selective recomputation redoes only the core attention and
is not counted (model FLOPs, not hardware FLOPs).

**Llama's blocks** change one block's forward per token (:func:`layer_forward_flops_per_token`):
with n query heads of d channels and g K/V groups the qkv GEMM is ``2 H (n + 2g) d`` (GQA: a
smaller K and V), attention ``4 s n d``, the projection ``2 n d H``; SwiGLU's MLP has three F x H
matrices, ``6 H F``, against GeLU's ``4 H F``; an untied output layer costs what the tied one
does (``2 H V``). RMSNorm, RoPE and the gating are elementwise, not counted (as Megatron).
**Mixture of experts** (``--num-experts``): each token runs the MLPs of the k experts it is routed
to (``--moe-router-topk``), so an MoE block's MLP term counts k times, as Megatron-LM's
``transformer_flops`` counts ``num_experts_routed_to = moe_router_topk``; the router's ``2 H E``
is not counted (nor by Megatron).

**Causal attention is counted in full** (``s/(6h)``): Q K^T and the scores times V are computed as
whole ``s x s`` products by both attention backends, and PyTorch's FLOP counter counts them so
(``tests/test_gpt_log.py`` checks the formula against ``torch.utils.flop_counter`` on the engine's
own model). Current Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py,
since March 2025) counts only the unmasked half, ``s/(12h)`` in place of ``s/(6h)``: its TFLOP/s
and MFU are lower than this engine's by ``12 B s^2 l h / 2`` FLOPs (:data:`CONVENTION` names the
choice in the run's log).

    TFLOP/s per device = F / (time per iteration x world size) / 1e12
    MFU                = TFLOP/s per device / peak of the device (when known)

A CPU has no published peak that its ranks could reach: :func:`measure_gemm_tflops` times large
square matrix multiplications (``2 n^3`` FLOPs each) instead, the best a run's GEMMs could do on
it with the threads it is given. The local cluster's ranks share one machine, so there MFU is the
job's total over the machine's measured peak (:func:`mfu`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from distlab.gpt.transformer.config import GPTConfig

#: Dense bf16/fp16 tensor-core peaks (TFLOP/s) by a substring of the device name.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "V100": 125.0,
    "L4": 121.0,
    "T4": 65.0,
}


CONVENTION = "causal attention counted in full: s/(6h); Megatron-LM since 2025 counts half: s/(12h)"
"""How the log's TFLOP/s and MFU count attention (printed once at start-up by :func:`flops_line`)."""


@dataclass(frozen=True)
class FlopsConfig:
    """What one iteration's model FLOPs depend on: the model's shape and one global batch."""

    model: GPTConfig
    """L, H, n, g, d, F, SwiGLU, the experts' top-k, V (padded) and the recomputation."""
    seq_length: int
    """s, tokens per sample."""
    global_batch_size: int
    """B, samples per iteration."""
    model_chunks: int = 1
    """pp x v: with block recomputation each chunk runs its first N blocks twice."""


def recomputed_layers(config: FlopsConfig) -> int:
    """Blocks whose forward runs twice per micro-batch: all ``l`` with full uniform recomputation,
    ``N`` per model chunk (``pp x v`` chunks) with full block recomputation, else 0."""
    m = config.model
    if m.recompute_granularity != "full":
        return 0
    if m.recompute_method == "block" and m.recompute_num_layers:
        return min(m.num_layers, m.recompute_num_layers * config.model_chunks)
    return m.num_layers


def layer_forward_flops_per_token(config: FlopsConfig) -> float:
    """One block's forward FLOPs per token: ``2 H (n + 2g) d`` (qkv) + ``4 s n d`` (Q K^T and the
    scores times V, in full) + ``2 n d H`` (projection) + ``2 H F`` x 2 matrices (GeLU) or x 3
    (SwiGLU's gate, up and down), as Megatron-LM's ``transformer_flops`` counts grouped-query
    attention and SwiGLU; with experts the MLP term k times (top-k routing). GPT-2 (g = n, n d = H,
    F = 4H): ``24 H^2 + 4 s H``."""
    m, s = config.model, config.seq_length
    h, d = m.hidden_size, m.head_dim
    q_width, kv_width = m.num_attention_heads * d, m.query_groups * d  # n d, g d
    routed = m.moe.topk if m.moe is not None else 1  # experts each token runs
    mlp = 2 * h * m.ffn * (3 if m.swiglu else 2) * routed
    return 2 * h * (q_width + 2 * kv_width) + 4 * s * q_width + 2 * q_width * h + mlp


def output_layer_flops(config: FlopsConfig) -> float:
    """The logit layer's forward + backward FLOPs of one global batch, ``6 B s h V`` (never
    recomputed; on the last pipeline stage)."""
    m = config.model
    return 6.0 * config.global_batch_size * config.seq_length * m.hidden_size * m.vocab_size


def model_flops_per_iteration(config: FlopsConfig) -> float:
    """Forward + backward FLOPs of one global batch: ``B s ((3 l + r) f + 6 h V)``, ``f`` one
    block's forward per token (:func:`layer_forward_flops_per_token`), ``r`` =
    :func:`recomputed_layers`; for GPT-2 ``24 B s h^2 (1 + s/(6h)) (3 l + r) + 6 B s h V``."""
    layers, r = config.model.num_layers, recomputed_layers(config)
    tokens = float(config.global_batch_size * config.seq_length)
    return tokens * (3 * layers + r) * layer_forward_flops_per_token(config) + output_layer_flops(config)


def flops_line(config: FlopsConfig) -> str:
    """The start-up line that says what the iteration lines' TFLOP/s and MFU count."""
    return f"> model FLOPs per iteration: {model_flops_per_iteration(config):.4g} ({CONVENTION})"


def counted_flops(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    vocab_size: int,
    seq_length: int,
    batch: int,
    recompute_granularity: str | None = None,
    checkpoint_early_stop: bool = True,
    **architecture,
) -> int:
    """FLOPs of one forward + backward of the engine's GPT on ``batch`` samples, as PyTorch's
    ``torch.utils.flop_counter.FlopCounterMode`` counts them (2 per multiply-add of every mm, addmm
    and bmm), independent of the formula above. The model is built on the meta device: nothing is
    computed or allocated, so GPT-2 small's shape costs what the tiny one does, and the fused
    attention decomposes into the two products it stands for. With ``recompute_granularity="full"``
    every block is its own checkpointed group; PyTorch's non-reentrant checkpoint stops recomputing
    once the tensors backward needs are rebuilt (``checkpoint_early_stop``, its default), so the last
    GEMM of each group (fc2, 8 B s h^2) is not run again, which the formula, as Megatron's, counts.
    ``architecture``: more ``GPTConfig`` fields (``swiglu``, ``num_query_groups``, ...)."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode

    from distlab.gpt.transformer.gpt_model import GPTModel  # the model imports this module's neighbours

    cfg = GPTConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=seq_length,
        recompute_granularity=recompute_granularity,
        recompute_method="uniform" if recompute_granularity == "full" else None,
        recompute_num_layers=1 if recompute_granularity == "full" else None,
        **architecture,
    )
    with torch.device("meta"):
        model = GPTModel(cfg)
        tokens = torch.zeros(batch, seq_length, dtype=torch.long)
    with FlopCounterMode(display=False) as counter, set_checkpoint_early_stop(checkpoint_early_stop):
        model(tokens, tokens).mean().backward()
    return counter.get_total_flops()


def device_peak_tflops(device: torch.device) -> float | None:
    """Peak TFLOP/s of the device, or None where unknown (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def measure_gemm_tflops(
    device: torch.device,
    size: int = 1024,
    rounds: int = 3,
    min_time_s: float = 0.2,
    threads: int | None = None,
) -> float:
    """Achieved TFLOP/s of ``(size x size) @ (size x size)`` matmuls on ``device`` (fp32 on a CPU,
    bf16 on a GPU, as the runs compute), the best of ``rounds`` timed rounds of at least
    ``min_time_s`` each, after one warm-up product. On a CPU it uses ``threads`` intra-op threads
    (torch's thread count is restored after), or torch's current thread count when None: a job's
    peak is that of the threads its ranks ran with, not of every core."""
    if threads is not None and device.type == "cpu":
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return measure_gemm_tflops(device, size, rounds, min_time_s)
        finally:
            torch.set_num_threads(before)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    a @ b  # noqa: B018  (warm-up: kernels and thread pool)
    best = 0.0
    for _ in range(rounds):
        count, start = 0, time.perf_counter()
        while True:
            a @ b  # noqa: B018
            count += 1
            sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_time_s:
                break
        best = max(best, 2.0 * size**3 * count / elapsed / 1e12)
    return best


def mfu(tflops_per_device: float, world_size: int, peak_tflops: float, shared_machine: bool) -> float:
    """Model FLOPs utilisation in [0, 1]: each device's TFLOP/s over its peak; where all ranks share
    one machine (the local cluster), the job's total ``tflops_per_device x world_size`` over the
    machine's peak."""
    achieved = tflops_per_device * world_size if shared_machine else tflops_per_device
    return achieved / peak_tflops
