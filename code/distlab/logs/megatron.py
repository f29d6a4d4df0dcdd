"""Megatron-format logs of ``pretrain_gpt.py`` runs, parsed into numbers.

What a log holds and the function that reads it:

    using world size: W, data-parallel-size: DP, tensor-model-parallel size: TP, ...   parse_banner
     > number of parameters on (tensor, pipeline) model parallel rank (t, p): N            parameter_counts
    [rank r tp t pp p dp d] memory (MiB): parameters ... | peak RSS M                     memory_rows
     iteration i/ n | consumed samples: ... | elapsed time per iteration (ms): ... |       iterations

A run's throughput, with global batch B and time per iteration t (first iteration left out: it
includes warm-up)::

    samples/s = B / t                 scaling efficiency of N devices = (samples/s)_N / (N x (samples/s)_1)

(weak scaling: the micro batch per device stays fixed and the global batch grows with N).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from distlab.gpt.log import ITERATION_RE
from distlab.gpt.parallel_state import ParallelDims, ParallelState

BANNER_RE = re.compile(
    r"using world size: (?P<world>\d+), data-parallel-size: (?P<dp>\d+), "
    r"tensor-model-parallel size: (?P<tp>\d+), pipeline-model-parallel size: (?P<pp>\d+)"
)
PARAMS_RE = re.compile(
    r"number of parameters on \(tensor, pipeline\) model parallel rank \((\d+), (\d+)\): (\d+)"
)
MEMORY_RE = re.compile(
    r"\[rank (?P<rank>\d+) tp (?P<tp>\d+) pp (?P<pp>\d+) dp (?P<dp>\d+)\] memory \(MiB\): "
    r"parameters (?P<params_mib>[\d.]+) \((?P<values>[\d,]+) values\) \| gradients (?P<grads_mib>[\d.]+) \| "
    r"optimizer state (?P<optim_mib>[\d.]+) \| (?P<peak_kind>peak RSS|CUDA max allocated) (?P<peak_mib>[\d.]+)"
)
BATCH_RE = re.compile(
    r"> global batch size (?P<global_batch>\d+) = micro batch (?P<micro_batch>\d+) x data-parallel (?P<dp>\d+) "
    r"x accumulation steps (?P<accumulation>\d+)"
)
THROUGHPUT_RE = re.compile(
    r"tokens per second: (?P<tokens>[\d.]+) \| TFLOP/s per device: (?P<tflops>[\d.]+) \|"
)

#: Reference (a well-known course): 12 layers, hidden 768, 32 heads, seq 1024, V100 16 GB, 100 iterations.
#: label -> (devices, global batch, ms per iteration)
REFERENCE_V100 = {
    "1 GPU": (1, 2, 271.6),
    "1 node x 2 GPUs": (2, 4, 363.6),
    "2 nodes x 2 GPUs": (4, 8, 537.3),
}


def banner_line(world_size: int, tp: int = 1, pp: int = 1) -> str:
    """The exact start-up line a run of this layout prints (the engine's own formatting)."""
    return ParallelState(dims=ParallelDims(world_size, tp, pp), rank=0).banner()


@dataclass(frozen=True)
class Banner:
    """The layout a run reports: world size = dp x tp x pp."""

    world_size: int
    dp: int
    tp: int
    pp: int

    def line(self) -> str:
        return banner_line(self.world_size, self.tp, self.pp)


def parse_banner(text: str) -> Banner:
    """The layout from the ``using world size:`` line; raise when the log has none."""
    m = BANNER_RE.search(text)
    if m is None:
        raise ValueError(
            "no 'using world size: ...' line in this log: the run failed before it set up its "
            "process groups (look at the log's error lines)"
        )
    return Banner(int(m["world"]), int(m["dp"]), int(m["tp"]), int(m["pp"]))


def split_runs(text: str) -> list[str]:
    """The log of a job that ran several trainings, cut before each ``using world size:`` line."""
    starts = [m.start() for m in BANNER_RE.finditer(text)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def batch_arithmetic(text: str) -> dict[str, int]:
    """The run's ``global = micro x dp x accumulation`` line as numbers (empty when absent)."""
    m = BATCH_RE.search(text)
    return {k: int(v) for k, v in m.groupdict().items()} if m else {}


def iterations(text: str) -> list[dict]:
    """Every iteration line as numbers: it, total, samples, ms, lr, gbs, loss, scale (the loss
    scale), skipped (skipped iterations in the interval), tokens_per_s, tflops."""
    rows = []
    for line in text.splitlines():
        m = ITERATION_RE.match(line)
        if m is None:
            continue
        row = {k: int(m[k]) for k in ("it", "total", "samples", "gbs", "skipped")}
        row.update({k: float(m[k]) for k in ("ms", "lr", "loss", "scale")})
        t = THROUGHPUT_RE.search(line)
        if t is not None:
            row.update(tokens_per_s=float(t["tokens"]), tflops=float(t["tflops"]))
        rows.append(row)
    return rows


def parameter_counts(text: str) -> dict[tuple[int, int], int]:
    """(tp_rank, pp_rank) -> parameters that model-parallel rank holds."""
    return {(int(t), int(p)): int(n) for t, p, n in PARAMS_RE.findall(text)}


def memory_rows(text: str) -> list[dict]:
    """The per-rank memory report printed after the first iteration, one dict per rank."""
    rows = []
    for m in MEMORY_RE.finditer(text):
        row = {k: int(m[k]) for k in ("rank", "tp", "pp", "dp")}
        row["values"] = int(m["values"].replace(",", ""))
        row.update({k: float(m[k]) for k in ("params_mib", "grads_mib", "optim_mib", "peak_mib")})
        row["peak_kind"] = m["peak_kind"]
        rows.append(row)
    return sorted(rows, key=lambda r: r["rank"])


def layout_and_completion(text: str) -> tuple[str, bool]:
    """(the banner line, or what is missing; True when the last iteration line was printed)."""
    try:
        banner = parse_banner(text).line()
    except ValueError:
        banner = "no 'using world size:' line (did the job start?)"
    its = iterations(text)
    return banner, bool(its) and its[-1]["it"] == its[-1]["total"]


def throughput(text: str, devices: int | None = None) -> dict:
    """devices, global batch, ms/iteration (after the first line), samples/s, tokens/s of one run."""
    its = iterations(text)
    if not its:
        raise ValueError("no iteration lines in this log: did the job train? Look at its error lines")
    steady = its[1:] or its
    ms = sum(r["ms"] for r in steady) / len(steady)
    n = devices if devices is not None else parse_banner(text).world_size
    row = {"devices": n, "global_batch": its[-1]["gbs"], "ms_per_iter": ms}
    row["samples_per_s"] = 1000.0 * row["global_batch"] / ms
    row["tokens_per_s"] = sum(r.get("tokens_per_s", 0.0) for r in steady) / len(steady)
    return row


def with_efficiency(rows: dict[str, dict]) -> dict[str, dict]:
    """Add weak-scaling efficiency against the first row: per-device samples/s ratio."""
    base = next(iter(rows.values()))
    per_device = base["samples_per_s"] / base["devices"]
    return {k: {**r, "efficiency": r["samples_per_s"] / r["devices"] / per_device} for k, r in rows.items()}


def reference_rows() -> dict[str, dict]:
    """The V100 reference runs as throughput rows (with efficiency)."""
    rows = {
        label: {"devices": n, "global_batch": b, "ms_per_iter": ms, "samples_per_s": 1000.0 * b / ms}
        for label, (n, b, ms) in REFERENCE_V100.items()
    }
    return with_efficiency(rows)
