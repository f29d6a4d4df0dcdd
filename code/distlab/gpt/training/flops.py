"""Model FLOPs of one iteration, TFLOP/s and model FLOPs utilisation (MFU).

Megatron's formula counts the matrix multiplications of one global batch of ``B`` samples of
length ``T``, ``L`` layers, width ``H``, vocabulary ``V`` (notation: ``distlab.gpt``'s legend);
forward + backward is 3 forwards (backward costs two), 4 with full recomputation (a second
forward of every block; selective recomputation redoes only the attention scores, not counted)::

    F = 24 c B T L H^2 (1 + T / (6 H) + V / (16 L H)),   c = 3 (or 4 with full recomputation)

    TFLOP/s per device = F / (time per iteration x world size) / 1e12
    MFU                = TFLOP/s per device / peak of the device (when known)

A CPU has no published peak that its ranks could reach: :func:`measure_gemm_tflops` times large
square matrix multiplications (``2 n^3`` FLOPs each) instead, the best a run's GEMMs could do on
it. The local cluster's ranks share one machine, so there MFU is the job's total over the
machine's measured peak (:func:`mfu`).
"""

from __future__ import annotations

import time

import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.transformer.recompute import granularity_of

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


def model_flops_per_iteration(args: PretrainArgs, vocab_size: int) -> float:
    """Forward + backward FLOPs of one global batch (see the module docstring)."""
    B, T, L, H = args.global_batch_size, args.seq_length, args.num_layers, args.hidden_size
    c = 4 if granularity_of(args.recompute_activations, args.recompute_granularity) == "full" else 3
    return 24.0 * c * B * T * L * H * H * (1.0 + T / (6.0 * H) + vocab_size / (16.0 * L * H))


def device_peak_tflops(device: torch.device) -> float | None:
    """Peak TFLOP/s of the device, or None where unknown (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def measure_gemm_tflops(
    device: torch.device, size: int = 1024, rounds: int = 3, min_time_s: float = 0.2
) -> float:
    """Achieved TFLOP/s of ``(size x size) @ (size x size)`` matmuls on ``device`` (fp32 on a CPU,
    bf16 on a GPU, as the runs compute), the best of ``rounds`` timed rounds of at least
    ``min_time_s`` each, after one warm-up product. On a CPU it uses torch's current thread count."""
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
