"""The log of a run that hung or crawled (notebook 12): who did not join, who is slow, and the check.

A hang (``distlab.flight_recorder``, printed by every rank that timed out)::

    > hang: a collective of iteration 8 waited 6.0 s (--distributed-timeout-minutes); no answer from ranks [2]
    > hang: ranks [2] did not join gloo:all_reduce #31 of group 3 (dp) [0, 2], sizes [[4161]]: rank 2 on node2 (pid 812)

The same report read from the dumps after the job, on gloo as on NCCL (``code/diagnose_hang.py
FOLDER``; NCCL's watchdog ends the processes before any of them prints the engine's report)::

    no dump from ranks {2}: frozen, dead or killed before the others' timeout (flight_recorder_81)
    3 of 4 ranks wrote a flight record in flight_recorder_81
    > hang: ranks [2] did not join nccl:all_reduce #31 of group 3 (dp) [0, 2], sizes [[4161]]: rank 2 on ...

A straggler (``--log-straggler``, rank 0, every ``--log-interval``; with ``--straggler-minmax-count
N`` the N lowest and highest ``TFLOP/s/rank`` pairs after it)::

    > straggler: iteration 10 | MnRtt/Rnk: 21.30ms/0 | MxRtt/Rnk: 58.12ms/2 | MnEtpt/Rnk: 1.2E-04TF/2 | ...
    ^^^^ Bottom 2 Ranks with lowest  Etpt(TF): 1.2E-04/2, 3.1E-04/1,

The exercise: a job whose batch script freezes or slows one random rank and keeps what it did in
``jobs/.answer-<job id>`` ("hang 2", "straggler 1"); :func:`check_fault` compares the learner's
answer with it.
"""

from __future__ import annotations

import re
from pathlib import Path

from distlab.checks import FIXME, check
from distlab.gpt.pretrain import HANG
from distlab.gpt.training.straggler import STRAGGLER

_PAIR = re.compile(r"([-+0-9.E]+)/(\d+),")
_DID_NOT_JOIN = re.compile(r"> hang: ranks \[([\d, ]+)\] did not join (.+?): rank")
_NO_DUMP = re.compile(r"^no dump from ranks \{([\d, ]+)\}", re.M)
_WROTE = re.compile(r"^\d+ of \d+ ranks wrote a flight record", re.M)


def hung_ranks(text: str) -> list[int] | None:
    """The ranks the first hang report names (None: no report)."""
    found = HANG.search(text)
    return None if found is None else [int(r) for r in found["ranks"].split(",") if r.strip()]


def ranks_without_dump(report: str) -> list[int] | None:
    """The ranks ``diagnose_hang.py``'s report says wrote no flight record ([]: every rank wrote
    one; None: no report, e.g. no dump at all)."""
    found = _NO_DUMP.search(report)
    if found is not None:
        return [int(r) for r in found.group(1).split(",") if r.strip()]
    return [] if _WROTE.search(report) else None


def missed_collectives(text: str) -> list[str]:
    """The collectives the report says the missing ranks did not join (each once)."""
    return list(dict.fromkeys(m.group(2) for m in _DID_NOT_JOIN.finditer(text)))


def slowest_ranks(text: str, after: int = 0) -> list[int]:
    """The rank of the longest forward-backward time (MxRtt) of every straggler report of an
    iteration above ``after``."""
    return [r["max_rank"] for r in STRAGGLER.parse(text) if r["iteration"] > after]


def rank_tflops(text: str) -> dict[int, list[tuple[int, float]]]:
    """rank -> [(iteration, TFLOP/s)] from the Bottom/Top lines after each straggler report (every
    rank when the minmax count is half the world)."""
    series: dict[int, list[tuple[int, float]]] = {}
    iteration = None
    for line in text.splitlines():
        report = STRAGGLER.search(line)
        if report is not None:
            iteration = report["iteration"]
        elif line.startswith("^^^^") and iteration is not None:
            for tf, rank in _PAIR.findall(line):
                points = series.setdefault(int(rank), [])
                if not points or points[-1][0] != iteration:
                    points.append((iteration, float(tf)))
    return series


def lowest_throughput_rank(text: str, after: int = 0) -> int | None:
    """The rank of the lowest mean TFLOP/s over the reports of iterations above ``after`` (every
    rank's throughput is in the reports when the minmax count is half the world); None: no reports.
    A mean over many intervals: one interval's minimum moves with a loaded machine's noise."""
    means = {
        rank: sum(tf for _, tf in late) / len(late)
        for rank, points in rank_tflops(text).items()
        if (late := [p for p in points if p[0] > after])
    }
    return min(means, key=means.get) if means else None


def check_fault(answer: tuple | str, job_id: int | str | None, folder: str | Path = "jobs") -> bool:
    """The exercise: ``answer`` = (fault, rank), fault "hang" or "straggler", against what the job's
    batch script did (``<folder>/.answer-<job id>``)."""
    name = "the hidden fault"
    if job_id is None:
        return check(name, FIXME, expected=True)
    fault, rank = (Path(folder) / f".answer-{job_id}").read_text().split()
    check(
        f"{name}: its kind", answer[0] if isinstance(answer, tuple) else answer, expected=fault,
        hint="a hang ends the job after the timeout and leaves flight records, which diagnose_hang.py "
        "reads (on gloo the log's '> hang' lines say the same); a straggler finishes, slowly, and "
        "--log-straggler names it",
    )  # fmt: skip
    return check(
        f"{name}: its rank", answer[1], expected=int(rank),
        hint="the hang report's 'no dump from ranks {r}', or the straggler report's MxRtt/Rnk and MnEtpt/Rnk",
    )  # fmt: skip


__all__ = [
    "check_fault",
    "hung_ranks",
    "lowest_throughput_rank",
    "missed_collectives",
    "rank_tflops",
    "ranks_without_dump",
    "slowest_ranks",
]
