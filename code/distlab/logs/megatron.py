"""Megatron-format logs of ``pretrain_gpt.py`` runs, parsed into numbers.

What a log holds and the function that reads it (each line defined beside its printer, see ``distlab.logs``)::

    using world size: W, data-parallel-size: DP, tensor-model-parallel size: TP, ...   parse_banner
    > global batch size B = micro batch b x data-parallel DP x accumulation steps m       batch_arithmetic
     > number of parameters on (tensor, pipeline) model parallel rank (t, p): N            parameter_counts
    [rank r tp t pp p dp d] memory (MiB): parameters ... | peak RSS M                     memory_rows
     iteration i/ n | consumed samples: ... | elapsed time per iteration (ms): ... |       iterations

A run's throughput, with global batch B and time per iteration t (first iteration left out: it
includes warm-up)::

    samples/s = B / t                 scaling efficiency of N devices = (samples/s)_N / (N x (samples/s)_1)

(weak scaling: the micro batch per device stays fixed and the global batch grows with N).
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.gpt.build import BATCH, PARAMETERS
from distlab.gpt.layout import Layout
from distlab.gpt.memory.meters import MEMORY, RANK_COORDS
from distlab.gpt.parallel_state import BANNER, ParallelState
from distlab.gpt.training.log import ITERATION

#: Reference (a well-known course): 12 layers, hidden 768, 32 heads, seq 1024, V100 16 GB, 100 iterations.
#: label -> (devices, global batch, ms per iteration)
REFERENCE_V100 = {
    "1 GPU": (1, 2, 271.6),
    "1 node x 2 GPUs": (2, 4, 363.6),
    "2 nodes x 2 GPUs": (4, 8, 537.3),
}


def banner_line(world_size: int, tp: int = 1, pp: int = 1) -> str:
    """The exact start-up line a run of this layout prints (the engine's own formatting)."""
    return ParallelState(layout=Layout(world_size, tp, pp), rank=0).banner()


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
    found = BANNER.search(text)
    if found is None:
        raise ValueError(
            "no 'using world size: ...' line in this log: the run failed before it set up its "
            "process groups (look at the log's error lines)"
        )
    return Banner(**found)


def split_runs(text: str) -> list[str]:
    """The log of a job that ran several trainings, cut before each ``using world size:`` line."""
    starts = [m.start() for m in BANNER.regex.finditer(text)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


def batch_arithmetic(text: str) -> dict[str, int]:
    """The run's ``global = micro x dp x accumulation`` line as numbers (empty when absent)."""
    return BATCH.search(text) or {}


def iterations(text: str) -> list[dict]:
    """Every iteration line as numbers: it, total, samples, ms, lr, gbs, loss, scale (the loss
    scale), gnorm (absent on a skipped step), skipped and nan (iterations in the interval), and
    when printed tokens_per_s, tflops, mfu_percent."""
    return ITERATION.parse(text)


def parameter_counts(text: str) -> dict[tuple[int, int], int]:
    """(tp_rank, pp_rank) -> parameters that model-parallel rank holds."""
    return {(r["tp_rank"], r["pp_rank"]): r["parameters"] for r in PARAMETERS.parse(text)}


def memory_rows(text: str) -> list[dict]:
    """The per-rank memory report printed after the first iteration, one dict per rank with its
    coordinates: rank, tp, pp, dp, values, params_mib, grads_mib, optim_mib, peak_kind, peak_mib."""
    rows = []
    for row in MEMORY.parse(text):
        coords = RANK_COORDS.search(row.pop("coords"))
        if coords is not None:
            rows.append(row | coords)
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
