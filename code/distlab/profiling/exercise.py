"""Notebook 06's exercise: which part of the step did a variant change, read from two traces.

share_g = (time in group g) / (step time), per rank-0 trace. A named part is right when its
share moved in the named direction by more than :data:`NOISE_POINTS` percentage points, or when
it vanished (``"down"`` to exactly zero, e.g. the communication of a run on one rank): a part
that is gone is gone whatever the load. On the local cluster's 2 shared cores two identical
DP=4 runs put 26% and 49% of the step in communication, so a smaller move is not a reading.
When computation grows, communication's share falls, and either answer is a true reading.
"""

from __future__ import annotations

from pathlib import Path

from distlab.checks import check, untouched
from distlab.profiling.traces import GROUPS, load_run

NOISE_POINTS = 25.0


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
    """The exercise's check: right when ``part``'s share moved ``direction`` by more than
    NOISE_POINTS points, or fell to zero from a share it had. The shares are printed once right."""
    if variant is None or untouched(part, direction):
        print("[not yet] run your variant and name the part of the step that changed (part, direction)")
        return False
    if part not in GROUPS or direction not in ("up", "down"):
        raise ValueError(
            f"part must be one of {list(GROUPS)} and direction 'up' or 'down', got {part!r}, {direction!r}"
        )
    table = share_table(baseline, variant)
    x, y = table[part]
    moved = 100 * (y - x) if direction == "up" else 100 * (x - y)
    vanished = direction == "down" and x > 0 and y == 0
    hint = (
        f"the {part} share did not move {direction} by more than {NOISE_POINTS:.0f} points (two "
        "identical runs differ by up to that here), nor vanish. Which part of the step does your "
        "variant remove, or add work to? Compare the bars, or the DIFF view"
    )
    ok = check(
        "the part of the step that changed",
        (part, direction),
        ok=lambda _: vanished or moved > NOISE_POINTS,
        hint=hint,
    )
    for g, (a, b) in table.items():
        print(f"{g:>14}: baseline {a:6.1%}  variant {b:6.1%}  ({100 * (b - a):+.1f} points)")
    return ok
