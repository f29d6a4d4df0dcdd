"""Notebook 07's reading of memory runs: the driver's prediction line, the job's cgroup peak and
limit, the CUDA cap, and one summary row per run (for the sweep plot and the fixes table);
notebook 11's bytes per parameter per rank (the distributed optimizer) from the ranks' memory lines.

    > memory: predicted peak 669.1 MiB | measured 709.2 MiB (peak RSS above the 690 MiB before the model) | error +6.0%
    job 223: peak 1116 MiB of its 1300 MiB limit (memory cgroup v1)        (code/job_peak_memory.py)
    > CUDA memory capped at 16 GiB of 79.2 GiB per rank (--device-memory-gib)   (a GPU site's budget)
"""

from __future__ import annotations

import re
import statistics

from distlab.gpt.memory.meters import PREDICTION
from distlab.logs.megatron import batch_arithmetic, iterations, memory_rows

JOB_PEAK_RE = re.compile(r"job \d+: peak (?P<peak>\d+) MiB of its (?P<limit>\d+) MiB limit")
OOM_RE = re.compile(r"out of memory|oom-kill|OutOfMemoryError", re.IGNORECASE)
#: ``memory.cap_device_memory``'s lines: the cap set, or the flag's value on a card smaller than it
CAP_RE = re.compile(
    r"^> (?:CUDA memory capped at (?P<capped>[\d.]+) GiB|--device-memory-gib (?P<above>[\d.]+): the card has only)",
    re.MULTILINE,
)


def prediction(text: str) -> dict:
    """The first prediction line: predicted, measured, baseline (MiB; 0 when the line names none),
    error (%), how; {} if absent."""
    found = PREDICTION.search(text)
    return {} if found is None else found | {"baseline": found.get("baseline", 0.0)}


def job_peak(text: str) -> dict:
    """``code/job_peak_memory.py``'s line: {"peak": MiB, "limit": MiB}; {} if absent."""
    m = JOB_PEAK_RE.search(text)
    return {"peak": float(m["peak"]), "limit": float(m["limit"])} if m else {}


def cap_mib(text: str) -> float | None:
    """``--device-memory-gib``'s budget in MiB where the driver printed its line (a GPU site: the
    cap set, or, on a card smaller than the cap, the flag's value, the card being the tighter
    budget); None when the run had no such flag."""
    cap = CAP_RE.search(text)
    return None if cap is None else 1024 * float(cap["capped"] or cap["above"])


def oom_lines(text: str) -> list[str]:
    """The lines a learner's ``grep -i "out of memory\\|oom"`` finds."""
    return [line for line in text.splitlines() if OOM_RE.search(line)]


def summary(text: str) -> dict:
    """One run: micro batch, accumulation, predicted/measured peak, job peak and
    limit (``#SBATCH --mem``), CUDA cap (``--device-memory-gib``), median ms per
    iteration after the first, losses, loss scales and skipped iterations (per log interval)."""
    its = iterations(text)
    batch = batch_arithmetic(text)
    later = [r["ms"] for r in its[1:]] or [r["ms"] for r in its]
    return {
        "micro": batch.get("micro_batch"),
        "accumulation": batch.get("accumulation"),
        **{f"{k}_mib": v for k, v in prediction(text).items() if k != "how" and k != "error"},
        "job_peak_mib": job_peak(text).get("peak"),
        "limit_mib": job_peak(text).get("limit"),
        "cap_mib": cap_mib(text),
        "ms": statistics.median(later) if later else None,
        "losses": [r["loss"] for r in its],
        "scales": [r["scale"] for r in its],
        "skipped": [r["skipped"] for r in its],
        "oom": bool(oom_lines(text)),
    }


def bytes_per_parameter(text: str) -> tuple[float, float]:
    """(parameters + gradients + optimizer state) / parameters of each rank, from its ``memory
    (MiB)`` line, averaged over the ranks; and how far the line's rounding may move it (each of
    the three is printed to 0.01 MiB: 3 x 0.005 MiB over the rank with the fewest values)."""
    rows = memory_rows(text)
    if not rows:
        raise ValueError(
            "no '[rank N ...] memory (MiB):' line in this log: did the run finish its first iteration?"
        )
    got = statistics.mean(
        (r["params_mib"] + r["grads_mib"] + r["optim_mib"]) * 2**20 / r["values"] for r in rows
    )
    return got, 3 * 0.005 * 2**20 / min(r["values"] for r in rows)
