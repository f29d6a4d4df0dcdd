"""Notebook 06's exercise: which part of the step did a variant change, read from two traces.

share_g = (time in group g) / (step time), per rank-0 trace. The variant trains the DP=4 run's
global batch on one rank with gradient accumulation, so what it changes is structural: its trace
has no gradient all-reduce, and communication's share falls from what the baseline had to exactly
zero, whatever the load. The check decides on that, not on the size of a move: on the local
cluster's 2 shared cores two identical DP=4 runs put 26% and 49% of the step in communication
(:data:`SPREAD_POINTS` apart), as large as most moves a variant makes. Right answers:

* ``("communication", "down")`` when communication vanished (baseline > 0, variant exactly 0);
* ``("computation", "up")`` when communication vanished and computation's share rose: it gains what
  the all-reduce took, 26 to 49 points, far more than "other" moves by.

"other" and "data loading" are not readings of this variant (they move by noise alone).
"""

from __future__ import annotations

from pathlib import Path

from distlab.checks import check, untouched
from distlab.profiling.traces import GROUPS, load_run

SPREAD_POINTS = 23.0
"""How far apart two identical DP=4 runs put communication's share here (26% and 49%)."""


def shares(run_dir: str | Path, worker: str = "rank0") -> dict[str, float]:
    """{group: share of the average step} of one traced rank of a run."""
    traces = load_run(run_dir)
    if worker not in traces:
        raise FileNotFoundError(f"{run_dir} has traces of {sorted(traces)}, not of {worker}")
    groups = traces[worker].groups_ms()
    total = sum(groups.values())
    return {g: v / total for g, v in groups.items()}


def share_table(baseline: str | Path, variant: str | Path) -> dict[str, tuple[float, float]]:
    """{group: (baseline share, variant share)} of two runs' rank-0 traces."""
    a, b = shares(baseline), shares(variant)
    return {g: (a[g], b[g]) for g in GROUPS}


def check_changed_part(baseline: str | Path, variant: str | Path | None, part: str, direction: str) -> bool:
    """The exercise's check: right when the variant's communication vanished (the baseline had some,
    the variant none) and the answer is communication down, or computation up with computation's
    share risen. The shares are printed once right."""
    if variant is None or untouched(part, direction):
        print("[not yet] run your variant and name the part of the step that changed (part, direction)")
        return False
    if part not in GROUPS or direction not in ("up", "down"):
        raise ValueError(
            f"part must be one of {list(GROUPS)} and direction 'up' or 'down', got {part!r}, {direction!r}"
        )
    table = share_table(baseline, variant)
    (comm_a, comm_b), (comp_a, comp_b) = table["communication"], table["computation"]
    vanished = comm_a > 0 and comm_b == 0
    if not vanished:
        hint = (
            f"your variant still spends {comm_b:.0%} of its step in communication (the baseline "
            f"{comm_a:.0%}): one rank has no gradient all-reduce. Is the variant one rank, and is "
            "the trace the check reads its own?"
        )
    else:
        hint = (
            f"{part} {direction} is not what your variant does to the step: which part does one rank "
            "with accumulation remove, and which part's share grows because of it? Compare the bars, "
            f"or the DIFF view (other and data loading move by noise alone: two identical runs put "
            f"communication {SPREAD_POINTS:.0f} points apart here)"
        )
    right = vanished and (
        (part, direction) == ("communication", "down")
        or ((part, direction) == ("computation", "up") and comp_b > comp_a)
    )
    ok = check("the part of the step that changed", (part, direction), ok=lambda _: right, hint=hint)
    for g, (a, b) in table.items():
        print(f"{g:>14}: baseline {a:6.1%}  variant {b:6.1%}  ({100 * (b - a):+.1f} points)")
    return ok
