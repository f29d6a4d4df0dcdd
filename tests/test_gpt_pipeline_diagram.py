"""The GPipe and 1F1B diagram of ``distlab.gpt.pipeline_parallel.schedules``'s docstring is what the schedules
do: each stage's order (as ``run_gpipe`` and ``run_1f1b`` post it), replayed with one slot per F or B
and each pass waiting for the neighbour it receives from, gives the drawn lines, and both leave
(p - 1)/(m + p - 1) of every stage idle (the bubble; GPipe's is not larger than 1F1B's)."""

from __future__ import annotations

import pytest

from distlab.gpt.pipeline_parallel import schedules as pipeline_parallel
from distlab.gpt.pipeline_parallel.timeline import theoretical_bubble

pytestmark = pytest.mark.engine_fast


def stage_order(schedule: str, p: int, m: int, s: int) -> list[tuple[str, int]]:
    """The passes of stage s in the order the engine's schedule runs them."""
    if schedule == "gpipe":  # run_gpipe: all forwards, then all backwards, in micro-batch order
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - s - 1, m)  # run_1f1b: warm-up forwards, one forward / one backward, cool-down
    order = [("F", i) for i in range(warmup)]
    for j in range(m - warmup):
        order += [("F", warmup + j), ("B", j)]
    return order + [("B", i) for i in range(m - warmup, m)]


def replay(schedule: str, p: int, m: int) -> list[list[str]]:
    """Each stage's slots ("F2", "B0", or ".." when idle): a pass starts when the stage is free and
    its input is there (F_i after F_i of stage s - 1, B_i after B_i of stage s + 1, or after the last
    stage's own F_i)."""
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, stage) -> slot it ends in
    orders = [stage_order(schedule, p, m, s) for s in range(p)]
    nxt, free = [0] * p, [0] * p
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            kind, i = orders[s][nxt[s]]
            need = ("F", i, s - 1) if kind == "F" else ("B", i, s + 1) if s < p - 1 else ("F", i, s)
            if kind == "F" and s == 0:
                ready = 0
            elif need in done:
                ready = done[need]
            else:
                continue
            start = max(free[s], ready)
            done[(kind, i, s)] = free[s] = start + 1
            nxt[s] += 1
            progressed = True
        assert progressed, "the schedule deadlocks"
    end = max(free)
    slots = [[".."] * end for _ in range(p)]
    for (kind, i, s), stop in done.items():
        slots[s][stop - 1] = f"{kind}{i}"
    return slots


def docstring_lines(name: str) -> list[list[str]]:
    lines = [ln for ln in pipeline_parallel.__doc__.splitlines() if "stage " in ln and ":" in ln]
    start = next(k for k, ln in enumerate(lines) if name in ln)
    return [ln.split(":", 1)[1].split("   ")[0].split() for ln in lines[start : start + 2]]


@pytest.mark.parametrize("schedule, name", [("gpipe", "GPipe"), ("1f1b", "1F1B")])
def test_docstring_diagram_is_the_schedule(schedule, name):
    drawn, replayed = docstring_lines(name), replay(schedule, 2, 4)
    assert drawn == replayed
    for stage in drawn:  # 2 idle slots of 10: (p - 1)/(m + p - 1) = 1/5
        assert stage.count("..") / len(stage) == pytest.approx(theoretical_bubble(2, 4))


@pytest.mark.parametrize("p, m", [(2, 1), (2, 8), (4, 4), (4, 8)])
def test_gpipe_and_1f1b_leave_the_same_bubble(p, m):
    for schedule in ("gpipe", "1f1b"):
        slots = replay(schedule, p, m)
        assert len(slots[0]) == 2 * (m + p - 1)
        assert all(row.count("..") / len(row) == pytest.approx(theoretical_bubble(p, m)) for row in slots)
