"""Model FLOPs of one iteration, TFLOP/s and model FLOPs utilisation (MFU).

Megatron's formula counts the matrix multiplications of one global batch of ``B`` samples of
length ``T``, ``L`` layers, width ``H``, vocabulary ``V`` (notation: ``distlab.gpt``'s legend);
forward + backward is 3 forwards (backward costs two), 4 with full recomputation (a second
forward of every block; selective recomputation redoes only the attention scores, not counted)::

    F = 24 c B T L H^2 (1 + T / (6 H) + V / (16 L H)),   c = 3 (or 4 with full recomputation)

    TFLOP/s per device = F / (time per iteration x world size) / 1e12
    MFU                = TFLOP/s per device / peak of the device (when known)
"""

from __future__ import annotations

import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.recompute import granularity_of

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
