"""Notebook 13's readers: dry runs read back from a job's log, local steps timed, and the exercise.

A dry run (``pretrain_gpt.py ... --dry-run-world-size N --dry-run-rank R``, ``planning/dry_run.py``)
prints, in GiB::

    > dry run: rank 1023 of 1024 (fake process group, model on the meta device)
    > parameters on this rank: 1,201,831,936 (bf16)
    >         2.24       4.48      13.43   20.15    53.07   without distributed optimizer
    > activations (estimator, 8 micro-batches): 32.92 GiB
    >   collective  tp           8  reduce_scatter      0.125000     328      41.0000

A job that runs several ranks at once with ``srun --label`` prefixes every line with its task
(``1: > dry run: ...``); :func:`dry_runs` sorts the lines by task before reading them.

The exercise: a layout (tp, pp, micro batch; no cp, no interleaving) of a model on a cluster,
within a memory budget; :func:`check_layout` accepts it when it is a valid layout, its predicted
peak is within the budget and its predicted step within ``tolerance`` of the fastest such layout
the planner found.
"""

from __future__ import annotations

import dataclasses
import re
import statistics

from distlab.checks import FIXME, check, untouched
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.validation import engine_layout
from distlab.gpt.planning.dry_run import (
    DRY_RUN,
    DRY_RUN_ACTIVATIONS,
    DRY_RUN_COLLECTIVE,
    DRY_RUN_PARAMETERS,
    DRY_RUN_STATES,
    GiB,
)
from distlab.gpt.planning.hardware import Hardware
from distlab.gpt.planning.planner import Candidate, evaluate, sized
from distlab.logs.megatron import iterations, split_runs

_LABEL = re.compile(r"^\s*(\d+): ", re.M)


def _by_task(text: str) -> list[str]:
    """The lines of each ``srun --label`` task, task by task (the whole text when unlabelled)."""
    if not _LABEL.search(text):
        return [text]
    tasks: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = _LABEL.match(line)
        if m:
            tasks.setdefault(int(m[1]), []).append(line[m.end() :])
    return ["\n".join(lines) for _, lines in sorted(tasks.items())]


def dry_runs(text: str) -> dict[int, dict]:
    """rank -> its report: world_size, parameters, precision, micro_batches, activations_gib,
    states ({"without": ..., "with": ...}: params_gib, grads_gib, optim_gib, total_gib, peak_gib)
    and collectives (group, size, op, gib_per_call, count, gib), in the order printed."""
    found = {}
    for task in _by_task(text):
        starts = [m.start() for m in DRY_RUN.regex.finditer(task)]
        for a, b in zip(starts, [*starts[1:], len(task)], strict=True):
            part = task[a:b]
            head = DRY_RUN.search(part)
            found[head["rank"]] = {
                "world_size": head["world_size"],
                **(DRY_RUN_PARAMETERS.search(part) or {}),
                **(DRY_RUN_ACTIVATIONS.search(part) or {}),
                "states": {row.pop("how"): row for row in DRY_RUN_STATES.parse(part)},
                "collectives": DRY_RUN_COLLECTIVE.parse(part),
            }
    return found


def gib_per_group(report: dict) -> dict[str, float]:
    """GiB one step moves in each group (the buffers' sizes, all calls), from :func:`dry_runs`."""
    out: dict[str, float] = {}
    for c in report["collectives"]:
        out[c["group"]] = out.get(c["group"], 0.0) + c["gib"]
    return out


def step_seconds(text: str) -> list[list[float]]:
    """Per run of a job's log (one ``using world size`` banner each): the seconds of every
    iteration after the first (which builds and warms up), from ``--log-interval 1`` lines."""
    return [[r["ms"] / 1000 for r in iterations(run)[1:]] for run in split_runs(text)]


def median_and_spread(seconds: list[float]) -> tuple[float, float, float]:
    """(median, first quartile, third quartile) of a run's iteration times."""
    if len(seconds) < 2:
        return (seconds[0],) * 3
    q1, q2, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
    return q2, q1, q3


def try_layout(
    args: PretrainArgs, world: int, hw: Hardware, budget_gib: float, *, tp, pp, micro_batch_size, vp=1
) -> Candidate | str:
    """The planner's view of one layout (cp 1) within ``budget_gib``: a :class:`Candidate`, or why
    the engine refuses it (``validate_args``' own message)."""
    name = f"tp {tp}, pp {pp}, vp {vp}, micro batch {micro_batch_size}"
    if not all(type(size) is int for size in (tp, pp, micro_batch_size, vp)):
        return f"{name} is not a layout here: give whole numbers"
    layout = engine_layout(sized(args, tp=tp, pp=pp, micro_batch_size=micro_batch_size, vp=vp), world)
    if isinstance(layout, str):
        return f"{name} is not a layout here: {layout}"
    return evaluate(args, layout, dataclasses.replace(hw, memory_bytes=budget_gib * GiB))


def fastest(candidates: list[Candidate], budget_gib: float) -> Candidate:
    """The fastest planned layout with cp 1 and vp 1 whose peak is within ``budget_gib``."""
    within = [
        c
        for c in candidates
        if (c.layout.cp, c.layout.vp) == (1, 1) and c.fits and c.peak <= budget_gib * GiB
    ]
    if not within:
        raise ValueError(f"no planned layout with cp 1 and vp 1 fits in {budget_gib} GiB: raise the budget")
    return min(within, key=lambda c: c.prediction.step)


def check_layout(
    answer: dict, args: PretrainArgs, world: int, hw: Hardware, budget_gib: float,
    candidates: list[Candidate], tolerance: float = 0.02,
) -> bool:  # fmt: skip
    """The exercise's check (see the module docstring); ``answer``: tp, pp, micro_batch_size."""
    name = f"a layout of {world} GPUs within {budget_gib:g} GiB"
    if untouched(answer):
        return check(name, FIXME, ok=bool)
    tried = try_layout(args, world, hw, budget_gib, **answer)
    best = fastest(candidates, budget_gib)
    if isinstance(tried, str):
        return check(name, answer, ok=lambda _: False, hint=tried)
    if not tried.fits:
        return check(name, answer, ok=lambda _: False, hint=f"{tried.name()} {tried.why()}.")
    slower = tried.prediction.step / best.prediction.step - 1
    hint = (
        f"{tried.name()} fits ({tried.why()}) but a step of {tried.prediction.step:.2f} s is "
        f"{100 * slower:.0f}% slower than the fastest layout that fits ({best.prediction.step:.2f} s): "
        "look at what your step spends outside compute."
    )
    return check(name, answer, ok=lambda _: slower <= tolerance, hint=hint)
