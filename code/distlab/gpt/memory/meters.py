"""Per-rank memory report: parameters, gradients, optimizer state, peak; the budget and the meter.

For a model of N parameters trained in fp32 with Adam, one rank holds about

    parameters 4N + gradients 4N + Adam's exp_avg and exp_avg_sq 8N = 16N bytes

plus activations, which is why tensor and pipeline parallelism (dividing N per rank) make
larger models fit. The per-rank line's peak is what the hardware saw: the CUDA caching
allocator's peak of allocated memory on a GPU, the process's peak resident set (``ru_maxrss``,
which includes the Python interpreter and libraries) on the CPU.

What training itself costs, to compare with ``memory_estimate``'s prediction, is measured by
:class:`PeakMeter` from just before the model is built: the CUDA allocator's peak above what was
allocated then, or on the CPU the peak resident set (``VmHWM``, its mark reset) above the
resident set then. :func:`cap_device_memory` is ``--device-memory-gib``: a CUDA budget that
makes an out-of-memory sweep fail at the same micro batch on a 16 GB and an 80 GB card.

On the CPU the resident set also holds what glibc's malloc keeps of freed tensors. By default its
mmap threshold starts at 128 KiB and rises to the size of every mapped block freed (up to 32 MiB),
so after the first large free, tensors come from the heap, and a freed one stays resident as a hole
that a later, larger tensor cannot reuse. Which holes exist at the peak depends on the order of
allocations and frees, and that order is not the same from run to run: the process has threads
beside the main one (OpenMP's workers; gloo's, which run every collective, also on one rank),
and the holes moved even with one OpenMP thread and the gradient bucket's all-reduce left out.
Measured on 2 shared cores (4 layers, b 16, 16 heads, unfused attention, 2 threads), one run read
between 305 and 342 MiB, the same run with selective recomputation between 173 and 287 MiB, in
steps of the 16 MiB score tensor: the 64 MiB the recomputation saves is inside that noise, and
notebook 07's check that the peak falls failed on a busy machine. :meth:`PeakMeter.start`
therefore fixes the threshold (``mallopt(M_MMAP_THRESHOLD, 64 KiB)``, what
``MALLOC_MMAP_THRESHOLD_=65536`` does from the start): every block above 64 KiB is its own
mapping, returned on free, and the peak above the baseline is the live tensors'. The same runs
then read 237.0-237.2 and 172.8-173.1 MiB beside 2 busy processes (233.1-233.3 and 169.1-169.2
with the variable set from the start), for 231.1 and 167.1 predicted. Mapping every block costs
page faults (an fp32 iteration at b 16 about a fifth slower), so :meth:`PeakMeter.stop`, after the
measured first iteration, sets glibc's ceiling instead (32 MiB, where its rising threshold ends).

This file measures; ``memory_estimate`` (torch-free) predicts, from a
:class:`~distlab.gpt.memory.memory_estimate.MemorySetup` built by ``MemorySetup.from_run``.
"""

from __future__ import annotations

import ctypes
import re
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.optimizer.distrib_optimizer import DistributedOptimizer
from distlab.gpt.optimizer.optimizer import is_dtensor
from distlab.log_line import LogLine, Opt

#: A rank's coordinates, the ``coords`` of its MEMORY line ("" when there is no layout).
RANK_COORDS = LogLine(" tp {tp:d} pp {pp:d} dp {dp:d}")
#: One rank's memory report, in MiB; ``peak_kind``: "peak RSS" (CPU) or "CUDA max allocated".
MEMORY = LogLine(
    "[rank {rank:d}{coords}] memory (MiB): parameters {params_mib:.2f} ({values:,d} values) | "
    "gradients {grads_mib:.2f} | optimizer state {optim_mib:.2f} | {peak_kind} {peak_mib:.1f}"
)
#: Predicted and measured peak above ``baseline`` (MiB), ``error`` = 100 (measured - predicted) / predicted.
PREDICTION = LogLine(
    "> memory: predicted peak {predicted:.1f} MiB | measured {measured:.1f} MiB ({how}",
    Opt(" above the {baseline:.0f} MiB before the model"),
    ") | error {error:+.1f}%",
)

MiB = 2**20
GiB = 2**30


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds: a DTensor's local shard (FSDP2; its ``numel()`` is the global size)."""
    return t.to_local() if is_dtensor(t) else t


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


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
    """This rank's numbers, in bytes (under ZeRO-3 its shard of each parameter, ``ds_tensor``; under
    FSDP2 the local shards of the DTensor parameters, gradients and Adam states; with the distributed
    optimizer the gradient buffers and its shards' fp32 copies and moments). The count of
    values is the whole model's in both (``ds_numel``, a DTensor's ``numel()``)."""
    params = list(model.parameters())
    peak, how = peak_memory_bytes(device)
    grads, optim = _bytes(p.grad for p in params if p.grad is not None), optimizer_state_bytes(optimizer)
    if isinstance(optimizer, DistributedOptimizer):  # the gradient buffers; its fp32 copies and moments
        grads = _bytes(b.grad_data for b in optimizer.buffer.buckets)
        optim = optimizer.state_bytes()
    return {
        "num_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "parameters": _bytes(getattr(p, "ds_tensor", p) for p in params),
        "gradients": grads,
        "optimizer_state": optim,
        "peak": peak,
        "peak_kind": how,
    }


def format_memory(rank: int, stats: dict, coords: str = "") -> str:
    """One line per rank, in MiB: :data:`MEMORY` (``coords``: :data:`RANK_COORDS`'s text, or "")."""
    return MEMORY.format(
        rank=rank,
        coords=coords,
        params_mib=stats["parameters"] / MiB,
        values=stats["num_parameters"],
        grads_mib=stats["gradients"] / MiB,
        optim_mib=stats["optimizer_state"] / MiB,
        peak_kind=stats["peak_kind"],
        peak_mib=stats["peak"] / MiB,
    )


def format_prediction(predicted: float, measured: float, how: str) -> str:
    """The line printed after the first iteration: ``memory_estimate``'s predicted peak against
    :class:`PeakMeter`'s measured one, bytes shown in MiB (:data:`PREDICTION`)."""
    error = 100.0 * (measured - predicted) / predicted
    return PREDICTION.format(predicted=predicted / MiB, measured=measured / MiB, how=how, error=error)


def memory_report(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device, state=None
) -> list[str]:
    """Every rank's line, gathered to all ranks (collective when a process group exists).

    ``state`` (a :class:`~distlab.gpt.parallel_state.ParallelState`) adds each rank's
    (tp, pp, dp) coordinates. Call it on every rank; print the result on one.
    """
    stats = memory_stats(model, optimizer, device)
    coords = (
        RANK_COORDS.format(tp=state.tp_rank, pp=state.pp_rank, dp=state.dp_rank) if state is not None else ""
    )
    line = format_memory(dist.get_rank() if dist.is_initialized() else 0, stats, coords)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [line]
    lines: list = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    return lines


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def reset_cpu_peak() -> int:
    """Reset the kernel's peak-RSS mark of this process (``clear_refs`` 5); return RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return 1024 * _status_kib("VmRSS")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 64 * 1024
MMAP_THRESHOLD_MAX = 32 * MiB  # glibc's ceiling for its rising threshold (64-bit); it trims at twice it


def _mallopt(param: int, value: int) -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(param, value) == 1


def fix_malloc_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """glibc: ``mallopt(M_MMAP_THRESHOLD, threshold)``, which also stops the threshold's rise: every
    block above ``threshold`` bytes is mapped on its own and unmapped on free. True when set; False
    where the C library has no ``mallopt`` (macOS) or ignores it (musl)."""
    return _mallopt(M_MMAP_THRESHOLD, threshold)


def release_malloc_threshold() -> bool:
    """After the measured iteration: thresholds where glibc's own rise ends (mmap 32 MiB, trim 64
    MiB), so that later iterations reuse freed heap memory instead of mapping, and faulting in,
    every block again (with the 64 KiB threshold an fp32 iteration of notebook 07's model at b 16
    took about a fifth longer). True when set."""
    mmap = _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    return _mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX) and mmap


def cpu_peak_since(baseline: int) -> int:
    """Peak RSS (``VmHWM``) above ``baseline`` bytes, since the last :func:`reset_cpu_peak`."""
    return 1024 * _status_kib("VmHWM") - baseline


@dataclass
class PeakMeter:
    """Peak bytes of what is allocated after :meth:`start` (the model, its states, activations)."""

    device: torch.device
    baseline: int = field(default=0, init=False)

    def start(self) -> PeakMeter:
        """Reset the peak mark and record the baseline (call just before building the model); on
        the CPU first fix malloc's mmap threshold (:func:`fix_malloc_threshold`, see the module's
        docstring), so that what is freed leaves the resident set."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            fix_malloc_threshold()
            self.baseline = reset_cpu_peak()
        return self

    def stop(self) -> None:
        """The measurement is over (the driver reads :meth:`peak` after the first iteration): on the
        CPU, :func:`release_malloc_threshold` for the speed of the iterations that follow."""
        if self.device.type != "cuda":
            release_malloc_threshold()

    def peak(self) -> tuple[int, str]:
        """(peak bytes above the baseline, how it was measured)."""
        before = f"above the {self.baseline / MiB:.0f} MiB before the model"
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(
                self.device
            ) - self.baseline, f"CUDA max allocated {before}"
        return cpu_peak_since(self.baseline), f"peak RSS {before}"


def cap_device_memory(gib: float | None, device: torch.device) -> str | None:
    """``--device-memory-gib``: cap the CUDA caching allocator of this process; the line to print.

    ``torch.cuda.set_per_process_memory_fraction(gib / total)``: an allocation beyond it raises
    ``torch.OutOfMemoryError`` as if the card were that small. On the CPU the budget is the job's
    memory limit (``#SBATCH --mem``), enforced by the kernel, so nothing is set here.
    """
    if gib is None:
        return None
    if device.type != "cuda":
        return f"> --device-memory-gib {gib:g} caps CUDA memory only: on {device.type} the budget is the job's --mem"
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * GiB >= total:
        return f"> --device-memory-gib {gib:g}: the card has only {total / GiB:.1f} GiB, no cap set"
    torch.cuda.set_per_process_memory_fraction(gib * GiB / total, device)
    return f"> CUDA memory capped at {gib:g} GiB of {total / GiB:.1f} GiB per rank (--device-memory-gib)"


def out_of_memory_message(exc: BaseException, micro_batch_size: int, device_memory_gib: float | None) -> str:
    """The one line an out-of-memory run prints before exiting: micro batch, cap, the error."""
    cap = f"--device-memory-gib {device_memory_gib:g}" if device_memory_gib else "no --device-memory-gib cap"
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"[rank {rank}] > out of memory at --micro-batch-size {micro_batch_size} ({cap}): {first}"
