"""Per-rank memory report: parameters, gradients, optimizer state, peak.

For a model of N parameters trained in fp32 with Adam, one rank holds about

    parameters 4N + gradients 4N + Adam's exp_avg and exp_avg_sq 8N = 16N bytes

plus activations, which is why tensor and pipeline parallelism (dividing N per rank) make
larger models fit. The peak is what the hardware saw: the CUDA caching allocator's peak of
allocated memory on a GPU, the process's peak resident set (``ru_maxrss``, which includes the
Python interpreter and libraries) on the CPU.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

MiB = 2**20


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state (Adam: exp_avg, exp_avg_sq)."""
    if optimizer is None:
        return 0
    return _bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(peak bytes, how measured): CUDA allocator peak on a GPU, peak RSS of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA max allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "peak RSS"  # Linux reports KiB


def memory_stats(model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> dict:
    """This rank's numbers, in bytes."""
    params = list(model.parameters())
    peak, how = peak_memory_bytes(device)
    return {
        "num_parameters": sum(p.numel() for p in params),
        "parameters": _bytes(params),
        "gradients": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": optimizer_state_bytes(optimizer),
        "peak": peak,
        "peak_kind": how,
    }


def format_memory(rank: int, stats: dict, coords: str = "") -> str:
    """One line per rank, in MiB."""
    return (
        f"[rank {rank}{coords}] memory (MiB): parameters {stats['parameters'] / MiB:.2f} "
        f"({stats['num_parameters']:,} values) | gradients {stats['gradients'] / MiB:.2f} | "
        f"optimizer state {stats['optimizer_state'] / MiB:.2f} | "
        f"{stats['peak_kind']} {stats['peak'] / MiB:.1f}"
    )


def memory_report(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device, state=None
) -> list[str]:
    """Every rank's line, gathered to all ranks (collective when a process group exists).

    ``state`` (a :class:`~distlab.gpt.parallel_state.ParallelState`) adds each rank's
    (tp, pp, dp) coordinates. Call it on every rank; print the result on one.
    """
    stats = memory_stats(model, optimizer, device)
    coords = f" tp {state.tp_rank} pp {state.pp_rank} dp {state.dp_rank}" if state is not None else ""
    line = format_memory(dist.get_rank() if dist.is_initialized() else 0, stats, coords)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [line]
    lines: list = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    return lines
