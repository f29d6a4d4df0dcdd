"""A machine as the step-time model sees it: GPUs per node, FLOP/s, memory, two links.

One small JSON file per machine in ``machines/`` (``h100_sxm_node``, ``a100_node``, from syllabus
section 13); the local cluster's figures are measured (:func:`measure_local`), as notebook 02
measures a collective's bus bandwidth (``distlab.comm.bench``) and notebook 04 the GEMM peak
(``training/flops.measure_gemm_tflops``)::

    peak_tflops          dense bf16 (GPUs) or measured fp32 GEMM (CPU) TFLOP/s of one device
    achieved_fraction    of the peak that the run's kernels reach (large GEMMs: ~0.8 on H100)
    flash_attention      whether attention skips the masked half of a causal mask (GPU kernels)
    intra_node, inter_node   bus bandwidth (GB/s, 1e9 B) per device and latency (us) of one
                         collective over a group inside one node, or spanning nodes
    elementwise          (optional) one memory-bound kernel's latency (us) and bandwidth (GB/s of
                         bytes read + written): what unfused work costs, as the engine's ring
                         attention and expert permutation run it (measured locally; absent from
                         the GPU files, whose fused kernels the achieved fraction describes)
    memory               (optional) a streaming copy's latency and bandwidth: what the update's
                         passes over every parameter cost (fused AdamW streams at about this rate)

A measured link may also carry its sweep (``measured``: per operation, (bytes, seconds) points
over ``measured_ranks`` ranks, as notebook 02's sweeps): a collective of that group size then
costs the sweep's time at its size, interpolated, instead of alpha + bytes / bandwidth. Gloo's
algorithms change with the size (a 512 KiB all-reduce here takes 1.5 to 1.8 times what a line
through 1 KiB and 8 MiB gives), which two figures cannot describe.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

FILES = Path(__file__).parent / "machines"


@dataclass(frozen=True)
class Link:
    """A collective's cost over this link: ``latency + factor(p) x bytes / bandwidth``, or its
    measured sweep's time (``measured``) for a group of ``measured_ranks`` ranks."""

    bandwidth: float  # bytes/s of bus bandwidth per device
    latency: float  # s per collective (alpha)
    measured_ranks: int = 0
    # op -> ((bytes, seconds), ...) ascending in bytes; the whole buffer, as nccl-tests' size
    measured: dict[str, tuple[tuple[float, float], ...]] = field(
        default_factory=dict, hash=False, compare=False
    )

    def measured_seconds(self, op: str, n: int, nbytes: float) -> float | None:
        """The sweep's seconds for ``op`` of ``nbytes`` over ``n`` ranks: linear between the two
        measured sizes around it, the smallest's time below them, the last segment extended above;
        None when the sweep has no such operation or group size."""
        points = self.measured.get(op) if n == self.measured_ranks else None
        if not points:
            return None
        if nbytes <= points[0][0] or len(points) == 1:
            return points[0][1]
        i = min(bisect.bisect_left([b for b, _ in points], nbytes), len(points) - 1)
        (b0, t0), (b1, t1) = points[i - 1], points[i]
        between = t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        return max(points[0][1], between)  # a noisy last segment must not extend below the smallest


@dataclass(frozen=True)
class Hardware:
    name: str
    gpus_per_node: int
    peak_flops: float  # FLOP/s of one device
    achieved_fraction: float
    memory_bytes: float
    intra_node: Link
    inter_node: Link
    flash_attention: bool = True  # fused attention skips causal attention's masked half (GPUs)
    source: str = ""
    elementwise: Link | None = None  # one memory-bound kernel: latency + bytes / bandwidth
    memory: Link | None = None  # a streaming copy: latency + bytes / bandwidth

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.achieved_fraction

    @classmethod
    def from_dict(cls, d: dict) -> Hardware:
        def link(x: dict) -> Link:
            sweep = x.get("measured", {})
            return Link(
                x["bandwidth_gbps"] * 1e9,
                x["latency_us"] * 1e-6,
                sweep.get("ranks", 0),
                {op: tuple((b, t) for b, t in pts) for op, pts in sweep.get("seconds", {}).items()},
            )

        return cls(
            name=d["name"],
            gpus_per_node=d["gpus_per_node"],
            peak_flops=d["peak_tflops"] * 1e12,
            achieved_fraction=d["achieved_fraction"],
            memory_bytes=d["memory_gib"] * 2**30,
            intra_node=link(d["intra_node"]),
            inter_node=link(d["inter_node"]),
            flash_attention=d.get("flash_attention", True),
            source=d.get("source", ""),
            elementwise=link(d["elementwise"]) if "elementwise" in d else None,
            memory=link(d["memory"]) if "memory" in d else None,
        )

    def to_dict(self) -> dict:
        def link(x: Link) -> dict:
            out = {"bandwidth_gbps": x.bandwidth / 1e9, "latency_us": x.latency * 1e6}
            if x.measured:
                seconds = {op: [list(p) for p in pts] for op, pts in x.measured.items()}
                out["measured"] = {"ranks": x.measured_ranks, "seconds": seconds}
            return out

        return {
            "name": self.name,
            "gpus_per_node": self.gpus_per_node,
            "peak_tflops": self.peak_flops / 1e12,
            "achieved_fraction": self.achieved_fraction,
            "memory_gib": self.memory_bytes / 2**30,
            "intra_node": link(self.intra_node),
            "inter_node": link(self.inter_node),
            "flash_attention": self.flash_attention,
            "source": self.source,
        } | {k: link(v) for k, v in (("elementwise", self.elementwise), ("memory", self.memory)) if v}


def load(name: str | Path) -> Hardware:
    """A machine by file name in ``machines/`` (``"h100_sxm_node"``) or by path."""
    path = Path(name)
    if not path.suffix:
        path = FILES / f"{name}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in FILES.glob("*.json")))
        raise FileNotFoundError(f"no hardware file {path}: give one of {known} or a JSON path")
    return Hardware.from_dict(json.loads(path.read_text()))
