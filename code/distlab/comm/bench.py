"""Bandwidth of collectives, measured the way nccl-tests reports it.

For a message of S bytes that an operation takes t seconds to complete (the slowest rank)::

    algbw = S / t                       # "algorithm bandwidth", GB/s with 1 GB = 1e9 B
    busbw = algbw x factor(n)           # what each link carried: comparable across n

    op               S counts                      factor(n)
    all_reduce       the tensor on each rank       2 (n - 1) / n
    ring_all_reduce  the same (our hand-written)   2 (n - 1) / n
    all_gather       the output (all ranks' data)  (n - 1) / n
    reduce_scatter   the input (all ranks' data)   (n - 1) / n
    broadcast        the tensor                    1
    sendrecv         what each rank sends          1   (rank r -> r + 1 while r - 1 -> r)

Example: all_reduce of 4 MB over n = 4 in 10 ms: algbw = 0.4 GB/s, busbw = 0.4 x 6/4 = 0.6 GB/s.
A ring all-reduce sends 2 (n - 1) / n x S bytes per rank, so busbw is the speed of one link.
"""

from __future__ import annotations

import csv
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.comm.ring import exchange, ring_all_reduce

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "ring_all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
OPS = list(BUS_FACTOR)
DTYPE = torch.float32
ELEM = 4  # bytes per float32 element
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes): ``nbytes / seconds``."""
    return nbytes / seconds / 1e9


def busbw(op: str, nbytes: int, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s: ``algbw x factor(n)`` with nccl-tests' factor for ``op``."""
    return algbw(nbytes, seconds) * BUS_FACTOR[op](n)


def parse_size(text: str) -> int:
    """``"4M"`` -> 4194304; suffixes K, M, G, T are powers of 1024 (an optional trailing B/iB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a message size: write bytes like 1024, 512K, 4M or 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(nbytes: float) -> str:
    """4194304 -> '4.0 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """``min, min x factor, ...`` up to ``max`` (inclusive when it lands on it)."""
    if min_bytes < ELEM or max_bytes < min_bytes or factor < 2:
        raise ValueError(
            f"bad size range: --min-size {min_bytes} B, --max-size {max_bytes} B, factor "
            f"{factor}: need {ELEM} B <= min <= max and factor >= 2"
        )
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def available_memory(device: torch.device) -> int:
    """Bytes this rank could still allocate: free GPU memory, or the node's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_memory(max_bytes: int, ranks_sharing: int, device: torch.device) -> None:
    """Fail before any allocation when ~3 buffers of ``max_bytes`` per rank cannot fit.

    ``ranks_sharing`` is how many ranks draw on the same pool (ranks per node on a CPU node, 1 on a
    GPU). Three buffers: all_gather needs S + S / n, the ring its tensor plus a chunk of scratch.
    """
    need = 3 * max_bytes * ranks_sharing
    have = available_memory(device)
    if need > 0.8 * have:
        fits = int(0.8 * have / (3 * ranks_sharing))
        raise ValueError(
            f"--max-size {human(max_bytes)} needs about 3 x {human(max_bytes)} x {ranks_sharing} rank(s) = "
            f"{human(need)} on {device.type}, but only {human(have)} is available: choose --max-size "
            f"{human(fits)} or less"
        )


def make_op(op: str, count: int, device: torch.device, group=None) -> Callable[[], None]:
    """Allocate the buffers for one message of ``count`` elements and return the call to time.

    ``count`` is a multiple of n; for all_gather / reduce_scatter it counts all ranks' data.
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if op in ("all_reduce", "ring_all_reduce", "broadcast"):
        buf = torch.zeros(count, dtype=DTYPE, device=device)  # zeros: repeated sums stay finite
        if op == "all_reduce":
            return lambda: dist.all_reduce(buf, group=group)
        if op == "ring_all_reduce":
            return lambda: ring_all_reduce(buf, group=group)
        return lambda: dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    if op in ("all_gather", "reduce_scatter"):
        big = torch.zeros(count, dtype=DTYPE, device=device)  # (count,)
        small = torch.zeros(count // n, dtype=DTYPE, device=device)  # (count / n,)
        if op == "all_gather":
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return lambda: gather(big, small, group=group)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(small, big, group=group)
    if op == "sendrecv":
        out = torch.zeros(count, dtype=DTYPE, device=device)
        inp = torch.zeros(count, dtype=DTYPE, device=device)
        right, left = (r + 1) % n, (r - 1) % n
        return lambda: exchange(out, right, inp, left, group)
    raise ValueError(f"unknown benchmark op {op!r}: choose from {', '.join(OPS)}")


@dataclass
class Row:
    """One measured point; ``bytes`` is S as defined in the module docstring."""

    label: str
    op: str
    bytes: int
    world_size: int
    nodes: int
    iters: int
    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    backend: str


def _agree_max(value: float, device: torch.device) -> float:
    """The maximum of ``value`` over all ranks (every rank gets it, so all decide alike)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_op(
    fn: Callable[[], None], device: torch.device, warmup: int, max_iters: int, budget_s: float
) -> tuple[float, int]:
    """Seconds per call (slowest rank) and the iteration count used, within about ``budget_s``."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    sync()
    first = _agree_max(time.perf_counter() - t0, device)
    iters = max(1, min(max_iters, int(budget_s / max(first, 1e-9))))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return _agree_max((time.perf_counter() - t0) / iters, device), iters


def sweep(
    ops: list[str],
    sizes: list[int],
    *,
    device: torch.device,
    backend: str,
    label: str,
    nodes: int,
    time_budget_s: float,
    warmup: int = 2,
    max_iters: int = 20,
    report: Callable[[str], None] = print,
) -> list[Row]:
    """Measure every op at every size, smallest first, sharing ``time_budget_s`` evenly per op.

    An op that has used its share skips its larger sizes (all ranks agree on when).
    """
    n = dist.get_world_size()
    per_op = time_budget_s / len(ops)
    rows: list[Row] = []
    for op in ops:
        start = time.perf_counter()
        for size in sizes:
            if _agree_max(time.perf_counter() - start, device) > per_op:
                report(f"bench {label} {op}: time budget used up, skipping sizes >= {human(size)}")
                break
            count = max(n, size // ELEM // n * n)  # a multiple of n elements
            nbytes = count * ELEM
            fn = make_op(op, count, device)
            seconds, iters = time_op(fn, device, warmup, max_iters, per_op / len(sizes))
            row = Row(
                label,
                op,
                nbytes,
                n,
                nodes,
                iters,
                seconds * 1e6,
                algbw(nbytes, seconds),
                busbw(op, nbytes, seconds, n),
                backend,
            )
            rows.append(row)
            report(
                f"bench {label} {op:<15} {nbytes:>9d} B  time {row.time_us:10.1f} us  "
                f"algbw {row.algbw_GBps:9.4g} GB/s  busbw {row.busbw_GBps:9.4g} GB/s  iters {iters}"
            )
    return rows


def write_results(rows: list[Row], csv_path: str | Path) -> tuple[Path, Path]:
    """Write rows to ``csv_path`` and the same rows as JSON next to it; return both paths."""
    csv_path = Path(csv_path)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(Row.__dataclass_fields__)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    json_path = csv_path.with_suffix(".json")
    json_path.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return csv_path, json_path


def read_results(csv_path: str | Path) -> list[Row]:
    """Rows back from a CSV written by :func:`write_results`."""
    with open(csv_path, newline="") as f:
        return [
            Row(**{k: type_(v) for (k, v), type_ in zip(rec.items(), _FIELD_TYPES, strict=True)})
            for rec in csv.DictReader(f)
        ]


_FIELD_TYPES = (str, str, int, int, int, int, float, float, float, str)
