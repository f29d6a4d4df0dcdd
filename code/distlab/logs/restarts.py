"""The log of a run that was interrupted and resumed (notebook 10): its attempts, their losses,
checkpoints and save times, a plot of the losses against an uninterrupted run, and the exercise's
check.

One job's log holds every attempt of its run: torchrun's restarts (``--max-restarts``) and a
requeued job's allocations (``--open-mode=append``) each start with Megatron's banner. What each
attempt says about where it started (``distlab.gpt.checkpointing.checkpointing.resume_line``)::

    > no checkpoint in D: starting from scratch                                  first attempt
    > loaded checkpoint from D at iteration 68                                   a new job or allocation
    > restart 1 of torchrun's --max-restarts 1: resuming from iteration 80, ...  torchrun restarted it
    > restart 1 of torchrun's --max-restarts 1: no checkpoint in D yet, ...      ... from scratch

its layout (``using world size: W, data-parallel-size: DP, ...`` and ``> global batch size B = micro
batch b x data-parallel DP x accumulation steps m``: an elastic restart on fewer nodes changes W,
DP and m, never B), and about its end: ``exiting program after receiving SIGUSR1 at iteration 68``
(``distlab.gpt.pretrain.EXIT_SIGNAL``). Saves: ``distlab.gpt.checkpointing.checkpointer.SAVED``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from distlab.checks import FIXME, check
from distlab.gpt.build import BATCH
from distlab.gpt.checkpointing.checkpointer import SAVED
from distlab.gpt.parallel_state import BANNER
from distlab.gpt.pretrain import EXIT_SIGNAL, HANG
from distlab.gpt.training.log import ITERATION
from distlab.logs.megatron import split_runs

#: Where an attempt started: group "restart" (torchrun's count) and "iteration" (None: from scratch).
_RESUME = re.compile(
    r"^> (?:restart (?P<restart>\d+) of torchrun's --max-restarts \d+: )?"
    r"(?:resuming from iteration (?P<resumed>\d+)|loaded checkpoint from .* at iteration (?P<loaded>\d+)"
    r"|no checkpoint in )",
    re.M,
)


@dataclass
class Attempt:
    """One start of the training in a job's log."""

    resumed_from: int  # the checkpoint's iteration, 0 from scratch
    restart: int  # torchrun's restart count (0: its first attempt, also of a requeued allocation)
    losses: dict[int, float] = field(default_factory=dict)  # iteration -> lm loss, as logged
    saved: list[int] = field(default_factory=list)  # iterations checkpointed
    save_ms: list[float] = field(default_factory=list)  # each save's total time
    exit_signal: int | None = None  # the iteration it stopped at on --exit-signal
    world_size: int = 0  # its layout (the banner; 0 when it died before printing it) ...
    dp: int = 0  # ... data-parallel size ...
    accumulation: int = 0  # ... and micro-batches per rank per iteration (global = micro x dp x this)

    @property
    def last(self) -> int:
        """The last iteration it logged (where it stopped or died)."""
        return max(self.losses, default=self.resumed_from)


def attempts(text: str) -> list[Attempt]:
    """Every attempt in a job's log, in order."""
    found = []
    for run in split_runs(text):
        m = _RESUME.search(run)
        resumed = int(m["resumed"] or m["loaded"] or 0) if m else 0
        attempt = Attempt(resumed_from=resumed, restart=int(m["restart"] or 0) if m else 0)
        attempt.losses = {r["it"]: r["loss"] for r in ITERATION.parse(run)}
        for save in SAVED.parse(run):
            attempt.saved.append(save["iteration"])
            attempt.save_ms.append(save["total_ms"])
        stop = EXIT_SIGNAL.search(run)
        attempt.exit_signal = stop["iteration"] if stop else None
        layout, batch = BANNER.search(run) or {}, BATCH.search(run) or {}
        attempt.world_size, attempt.dp = layout.get("world_size", 0), layout.get("dp", 0)
        attempt.accumulation = batch.get("accumulation", 0)
        found.append(attempt)
    return found


def final_losses(text: str) -> dict[int, float]:
    """Iteration -> loss of the whole job, a later attempt's line replacing an earlier one's."""
    merged: dict[int, float] = {}
    for attempt in attempts(text):
        merged.update(attempt.losses)
    return dict(sorted(merged.items()))


def largest_difference(text: str, reference: dict[int, float]) -> float:
    """The largest |loss - reference loss| over the reference's iterations (inf if one is missing)."""
    got = final_losses(text)
    if set(reference) - set(got):
        return float("inf")
    return max(abs(got[it] - loss) for it, loss in reference.items())


ASYNC_BLOCKING_SHARE = 0.7
"""The most of an asynchronous save's time that may block training, median over the saves of a run:
a save whose write ran beside training blocks only while the state is staged. Notebook 10's
one-rank saves of ~100 MB (4 per run, one rank on 2 shared cores, load about 10) measured a
median blocking / median total of 0.22 to 0.43 in 5 runs (single saves 0.08 to 0.68, the first
with DCP's set-up); a save that blocks for its whole write gives 1. Blocking time against a plain
save's is no check here: the plain saves' medians spread over 0.31-0.62 s and the asynchronous
blocking medians over 0.33-0.43 s in the same runs."""


def save_costs(text: str) -> dict:
    """Medians (ms) of a log's saves: ``plain`` (the synchronous ones, either format: blocking =
    total), and of the asynchronous ones ``async_blocking`` and ``async_total``, with
    ``async_saves`` their count, and ``overlapped``: whether the asynchronous saves blocked at most
    :data:`ASYNC_BLOCKING_SHARE` of their time (their write ran beside training)."""
    import statistics

    saves = SAVED.parse(text)
    plain = [s["blocking_ms"] for s in saves if s.get("mode") != "async"]
    staged = [(s["blocking_ms"], s["total_ms"]) for s in saves if s.get("mode") == "async"]
    out = {"plain": statistics.median(plain) if plain else None, "async_saves": len(staged)}
    if staged:
        out["async_blocking"] = statistics.median(b for b, _ in staged)
        out["async_total"] = statistics.median(t for _, t in staged)
        out["overlapped"] = out["async_blocking"] <= ASYNC_BLOCKING_SHARE * out["async_total"]
    return out


def hang_report(text: str) -> dict | None:
    """Rank 0's line after a collective timed out: iteration, timeout_s, ranks (a list)."""
    found = HANG.search(text)
    if found is None:
        return None
    return {**found, "ranks": [int(r) for r in found["ranks"].split(",") if r.strip()]}


def plot_attempts(ax, reference: dict[int, float], text: str, title: str = ""):
    """The reference run's losses (a grey line) and each attempt's (markers), the iterations an
    attempt recomputed shaded, a dashed line where an attempt died or stopped."""
    ax.plot(list(reference), list(reference.values()), color="0.6", lw=3, label="uninterrupted run")
    runs = attempts(text)
    for i, attempt in enumerate(runs):
        its = sorted(attempt.losses)
        ax.plot(its, [attempt.losses[it] for it in its], ".", ms=3, label=f"attempt {i + 1}")
        if i + 1 < len(runs):
            how = "stopped" if attempt.exit_signal else "died"
            ax.axvline(attempt.last, color="red", ls="--", lw=1)
            ax.text(
                attempt.last,
                ax.get_ylim()[1],
                f" {how} after {attempt.last}",
                color="red",
                va="top",
                fontsize=8,
            )
            resumed = runs[i + 1].resumed_from
            if resumed < attempt.last:
                ax.axvspan(
                    resumed, attempt.last, color="orange", alpha=0.25, label="recomputed" if i == 0 else None
                )
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return ax


def check_survived(
    text: str | None, reference: dict[int, float], *, max_interval: int, tol: float = 1e-5,
    name: str = "the run survived",
) -> bool:  # fmt: skip
    """The exercise: the job's log (None: not run yet) shows a restart after the killed rank, a
    resume from a checkpoint (not from scratch), checkpoints at most ``max_interval`` iterations
    apart, and the reference's losses at every iteration (within ``tol``: exact on the CPU, where
    kernels sum in a fixed order)."""
    if text is None:
        return check(name, FIXME, expected=True)
    runs = attempts(text)  # without --load an attempt says nothing of a restart: count the attempts
    check(
        "torchrun restarted the workers", len(runs) > 1, expected=True,
        hint="after a rank dies, torchrun restarts all workers only if --max-restarts allows it (>= 1)",
    )  # fmt: skip
    check(
        "the restart resumed from a checkpoint", runs[1].resumed_from > 0, expected=True,
        hint="it started from scratch: does the run --load the folder it --save-s into, and was a checkpoint "
        "written before the kill?",
    )  # fmt: skip
    saved = sorted({it for a in runs for it in a.saved})
    gaps = [b - a for a, b in itertools.pairwise([0, *saved])]
    check(
        f"checkpoints at most {max_interval} iterations apart", max(gaps, default=10**9), ok=lambda g: g <= max_interval,
        hint=f"a failure costs up to one save interval of recomputation: --save-interval <= {max_interval}",
    )  # fmt: skip
    diff = largest_difference(text, reference)
    return check(
        f"{name}: its losses are the uninterrupted run's", diff, ok=lambda d: d <= tol,
        hint="a resumed run must continue the same trajectory: the same arguments as the reference run, "
        "and the model, optimizer, data position and RNG from the checkpoint",
    )  # fmt: skip


__all__ = [
    "ASYNC_BLOCKING_SHARE",
    "Attempt",
    "attempts",
    "check_survived",
    "final_losses",
    "hang_report",
    "largest_difference",
    "plot_attempts",
    "save_costs",
]
