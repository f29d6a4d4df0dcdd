"""Notebook 05's exercise: the one-forward-one-backward (1F1B) order of a pipeline, and its checker.

The learner writes ``one_f_one_b(p, m)``: for p stages and m micro-batches, each stage's passes in
the order it runs them, ``[[("F", 0), ("F", 1), ("B", 0), ...], ...]`` (stage 0 first). The check
replays the orders as a pipeline runs them (:func:`replay`), one unit of time per pass, F and B
alike:

* stage s runs its list in order, one pass at a time, each as soon as it may: F_i once stage s - 1
  has finished F_i (stage 0: at once), B_i once stage s + 1 has finished B_i and stage s its own
  F_i (the last stage: once its own F_i is done, the loss);
* a deadlock (no stage can start its next pass while some have passes left) is reported with what
  each stuck stage waits for.

An order is right when, for every (p, m) of :data:`CASES`: every stage runs each micro-batch's F
and B exactly once; the replay finishes; the stages idle (p - 1)/(m + p - 1) of the step, the bubble
of an ideal pipeline of unit-time passes; and stage s holds at most p - s micro-batches' activations
at once (forwarded, not yet backwarded). GPipe's order (all forwards, then all backwards) is valid
and has the same bubble but holds m; an order that waits for each backward before the next forward
holds few but idles longer. The engine's order (``schedules.run_1f1b``, also what its timelines
measure in ``distlab.logs.pipeline``) passes: ``tests/test_exercise_pipeline_order.py``.

The notebook's prediction of the pipeline job's bubble is judged here too
(:func:`check_bubble_prediction`): the expected values are computed here, not shown before.
"""

from __future__ import annotations

from collections.abc import Callable

from distlab.checks import FIXME, check, untouched
from distlab.gpt.pipeline_parallel.timeline import theoretical_bubble

NAME = "the 1F1B order"
CASES = ((2, 1), (2, 4), (3, 5), (4, 2), (4, 8))
"""(p, m) the check replays: m < p, m = p, m > p, one micro-batch."""
SHOWN = (4, 8)  # the (p, m) whose replay the check draws when the order is right

Order = list[list[tuple[str, int]]]

FORMAT_HINT = (
    "Return one list per stage (p lists, stage 0 first), each the passes of that stage in order as "
    'tuples ("F", i) or ("B", i) (or strings "F3"), i the micro-batch, 0 to m - 1.'
)
MISSING_HINT = "Every stage runs the forward and the backward of each of the m micro-batches, each once."
OWN_FORWARD_HINT = (
    "A stage can run B_i only after its own F_i: the backward needs the activations the forward kept."
)
DEADLOCK_HINT = (
    "Each stuck stage waits for a pass that another stage has put after the one it is stuck on. Follow "
    "one micro-batch: its forwards go down the stages, its backwards come back up, and every stage "
    "must reach them in an order the others can serve."
)
MEMORY_HINT = (
    "Valid, and the bubble is the ideal one, but too many micro-batches are alive at once: 1F1B keeps "
    "at most p - s on stage s. When can stage s start its first backward, and what does it do after?"
)
BUBBLE_HINT = (
    "Valid, but your stages wait longer than an ideal pipeline's (p - 1)/(m + p - 1): a stage waiting "
    "for a backward could run a forward meanwhile. How many forwards can stage s start before its first "
    "backward can arrive, without holding more than p - s micro-batches?"
)


def _normalise(orders, p: int) -> Order | None:
    """``orders`` as p lists of (kind, i) tuples, or None when it is not that shape."""
    if not isinstance(orders, (list, tuple)) or len(orders) != p:
        return None
    out = []
    for stage in orders:
        if not isinstance(stage, (list, tuple)):
            return None
        passes = []
        for step in stage:
            if isinstance(step, str) and step[:1] in ("F", "B") and step[1:].isdigit():
                step = (step[0], int(step[1:]))  # "F3", as the timelines print them
            if not (isinstance(step, (list, tuple)) and len(step) == 2 and step[0] in ("F", "B")):
                return None
            if not isinstance(step[1], int) or isinstance(step[1], bool):
                return None
            passes.append((step[0], step[1]))
        out.append(passes)
    return out


def labels(orders) -> list[list[str]] | None:
    """Each stage's passes as the timelines print them (``["F0", "F1", "B0", ...]``), or None when
    ``orders`` is not one list of passes per stage."""
    got = _normalise(orders, len(orders)) if isinstance(orders, (list, tuple)) else None
    return None if got is None else [[f"{k}{i}" for k, i in order] for order in got]


def replay(orders: Order) -> tuple[dict[tuple[str, int, int], int], list[str]]:
    """Run each stage's list in order, each pass (one unit of time) as soon as its inputs are
    there: (finish time of each (kind, micro-batch, stage), what each stuck stage waits for; empty
    when the replay finished)."""
    p = len(orders)
    done: dict[tuple[str, int, int], int] = {}
    nxt, free = [0] * p, [0] * p
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                needs = _needs(kind, i, s, p)
                if not all(n in done for n in needs):
                    break
                start = max([free[s], *(done[n] for n in needs)])
                done[kind, i, s] = free[s] = start + 1
                nxt[s] += 1
                progressed = True
        if not progressed:
            stuck = []
            for s in range(p):
                if nxt[s] < len(orders[s]):
                    kind, i = orders[s][nxt[s]]
                    missing = [n for n in _needs(kind, i, s, p) if n not in done]
                    stuck.append(f"stage {s} waits to run {kind}{i}, which needs " + " and ".join(
                        f"{k}{j} of stage {t}" for k, j, t in missing))  # fmt: skip
            return done, stuck
    return done, []


def _needs(kind: str, i: int, s: int, p: int) -> list[tuple[str, int, int]]:
    """The passes that must have finished before ``kind`` of micro-batch i on stage s."""
    if kind == "F":
        return [] if s == 0 else [("F", i, s - 1)]
    return [("F", i, s)] + ([("B", i, s + 1)] if s < p - 1 else [])


def in_flight(order: list[tuple[str, int]]) -> int:
    """Most micro-batches a stage holds at once: forwarded, not yet backwarded."""
    alive = peak = 0
    for kind, _ in order:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak


def bubble(done: dict[tuple[str, int, int], int], p: int, m: int) -> float:
    """Idle share of the stages over the step (the replay's last finish): 1 - 2 m p / (p T)."""
    return 1 - 2 * m / max(done.values())


def chart(orders: Order) -> str:
    """The replay as one line of slots per stage (``F3``, ``B0``, ``..`` idle), as
    ``schedules.py``'s docstring draws GPipe and 1F1B."""
    done, _ = replay(orders)
    end = max(done.values(), default=0)
    rows = [[".."] * end for _ in orders]
    for (kind, i, s), stop in done.items():
        rows[s][stop - 1] = f"{kind}{i}"
    return "\n".join(f"stage {s}: " + " ".join(f"{c:>3}" for c in row) for s, row in enumerate(rows))


def _judge_case(orders, p: int, m: int) -> tuple[str, bool, str] | None:
    """(what to show, right?, hint) for a wrong order at (p, m); None when it is right there."""
    where = f"p = {p}, m = {m}: "
    got = _normalise(orders, p)
    if got is None:
        return where + f"it returned {str(orders)[:80]}", False, FORMAT_HINT
    want = sorted((k, i) for k in ("F", "B") for i in range(m))
    for s, order in enumerate(got):
        if sorted(order) != want:
            fs, bs = ([i for k, i in order if k == kind] for kind in ("F", "B"))
            return where + f"stage {s} runs F of {fs} and B of {bs}", False, MISSING_HINT
        for i in range(m):
            if order.index(("B", i)) < order.index(("F", i)):
                return where + f"stage {s} lists B{i} before its F{i}", False, OWN_FORWARD_HINT
    done, stuck = replay(got)
    if stuck:
        return where + "deadlock: " + "; ".join(stuck), False, DEADLOCK_HINT
    idle, ideal = bubble(done, p, m), theoretical_bubble(p, m)
    if idle > ideal + 1e-9:
        return where + f"the stages idle {idle:.1%} of the step, against {ideal:.1%}", False, BUBBLE_HINT
    alive = [in_flight(order) for order in got]
    if any(a > p - s for s, a in enumerate(alive)):
        return where + f"micro-batches alive at most, stage by stage: {alive}", False, MEMORY_HINT
    return None


def judge(one_f_one_b: Callable[[int, int], Order]) -> tuple[object, bool, str]:
    """(what to show of the answer, right?, hint): ``FIXME`` while the function returns its stub's
    placeholder; otherwise the first case of :data:`CASES` where it is wrong, or what it achieves."""
    for p, m in CASES:
        try:
            orders = one_f_one_b(p, m)
        except Exception as exc:  # the learner's code: any error is an answer to explain
            return f"p = {p}, m = {m}: your function raised {type(exc).__name__}: {exc}", False, FORMAT_HINT
        if untouched(orders):
            return FIXME, False, ""
        wrong = _judge_case(orders, p, m)
        if wrong:
            return wrong
    p, m = SHOWN
    orders = _normalise(one_f_one_b(p, m), p)
    done, _ = replay(orders)
    alive = [in_flight(order) for order in orders]
    said = (
        f"valid for (p, m) in {list(CASES)}; at p = {p}, m = {m} the stages idle {bubble(done, p, m):.1%} of the "
        f"step ((p - 1)/(m + p - 1) = {theoretical_bubble(p, m):.1%}) and hold at most {alive} micro-batches"
    )
    return said, True, ""


def check_order(one_f_one_b: Callable[[int, int], Order], *, name: str = NAME) -> bool:
    """``check`` the learner's ``one_f_one_b(p, m)`` (:func:`judge`): ``[ok]`` and the replay's
    chart at p = 4, m = 8; ``[not yet]`` while it returns FIXME; ExerciseError with a hint."""
    said, right, hint = judge(one_f_one_b)
    ok = check(name, said, ok=lambda _: right, hint=hint)
    if ok:
        print(chart(_normalise(one_f_one_b(*SHOWN), SHOWN[0])))
    return ok


BUBBLE_PREDICTION = "the bubble of the PP = 4 runs"


def check_bubble_prediction(
    predicted, *, stages: int = 4, micro_batches: tuple[int, ...] = (1, 8), timelines: dict | None = None
) -> bool:
    """The learner's ``{m: bubble}`` for each m of ``micro_batches``: the share of the step each stage
    idles in an ideal pipeline of ``stages`` stages and m micro-batches per step, each within 0.01 of
    (p - 1)/(m + p - 1). ``timelines`` ({m: a loaded timeline}): the runs', their measured bubble
    printed beside."""
    expected = {m: theoretical_bubble(stages, m) for m in micro_batches}

    def ok(p) -> bool:
        return (
            isinstance(p, dict)
            and set(p) == set(expected)
            and all(isinstance(v, (int, float)) and abs(v - expected[m]) <= 0.01 for m, v in p.items())
        )

    right = check(
        BUBBLE_PREDICTION,
        predicted,
        ok=ok,
        hint=f"a fraction between 0 and 1 for each m of {list(micro_batches)}, p = {stages}: how many of a "
        "stage's unit slots idle while the pipeline fills and drains, out of how many in the step?",
    )
    for m, tl in (timelines or {}).items():
        print(
            f"m = {m}: measured {tl['measured_bubble']:.2f} of the last step, ideal {expected.get(m, float('nan')):.2f}"
        )
    return right


__all__ = [
    "bubble",
    "chart",
    "check_bubble_prediction",
    "check_order",
    "in_flight",
    "judge",
    "labels",
    "replay",
]
