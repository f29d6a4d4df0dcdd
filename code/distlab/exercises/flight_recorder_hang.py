"""Notebook 12's exercise: from a hung run's flight-recorder dumps, the rank that hangs it and the
collective the others wait in for it.

The learner writes ``find_hang(folder) -> (rank, group, seq)`` that unpickles the dumps
``<folder>/rank_<N>`` (``distlab.flight_recorder``'s, PyTorch's format): ``rank`` the rank that never
joined, ``group`` the name of the process group (as the dumps spell it, ``"1"``), ``seq`` the
collective's sequence number in that group. :func:`check_hang` runs it on the notebook's own dumps
and compares with what the course's analyzer finds there (:func:`expected`, the rules of
``distlab.flight_recorder.hang_report`` that ``diagnose_hang.py`` prints):

* the rank: one that wrote no dump (frozen, dead), or, where every rank dumped (NCCL's watchdog dumps
  them all), a member of the collective that waits in none and never entered it; never a rank that
  waits in a collective of its own (it waits for someone else: a cascade, not the cause);
* the collective: one a surviving rank waits in (its last unfinished entry, else what the engine saw
  it wait in, ``distlab_waiting``) whose members include that rank and which has a sequence number
  (the pipeline's point-to-point transfers have none on gloo: the recorder does not list them).

A wrong answer is told what is wrong with it (a rank that wrote a dump, one waiting in a collective
of its own, a group the rank is not in, a collective it did join) without naming the right one.
PyTorch's analyzer (``torchfrtrace``) agrees where it can decide: where every rank dumped; with a
rank's dump missing it names that rank and stops (tests/test_exercise_flight_recorder_hang.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distlab import progress
from distlab.checks import FIXME, check, untouched
from distlab.flight_recorder import Collective, joined, last_collectives, read_dumps, read_hosts

NAME = "the rank and the collective of the hang, from the flight records"
FORMAT_HINT = (
    "Return (rank, group, seq): the rank as an int, the process group's name as the dumps spell it "
    "(entry['process_group'][0], or a key of pg_config: a string such as '1'), the collective's "
    "sequence number in that group (entry['collective_seq_id'])."
)
ALIVE_HINT = (
    "Rank {rank} wrote a flight record: it was alive when its collective timed out, like every rank that "
    "wrote one (which of them timed out first tells nothing). The rank that hangs the job is one the "
    "others wait for, and that waits for no one."
)
UNAWAITED_HINT = "No rank waits in a collective that holds rank {rank}: the others wait for someone else."
VICTIM_HINT = (
    "Rank {rank}'s record stops short of a collective another rank waits in, but rank {rank} is waiting "
    "too, in a collective of its own (group {group}): it waits for someone else. Follow the chain to a "
    "rank that waits for no one."
)
NOT_A_RANK_HINT = "This job's ranks are those of its default group, {world}."
UNKNOWN_GROUP_HINT = "No dump knows a group named {group!r}: the names are the keys of each dump's pg_config."
NOT_A_MEMBER_HINT = (
    "Group {group} ({desc}) holds ranks {members}: rank {rank} is not among them, so no one waits for "
    "it there. Which groups hold rank {rank}, and which of their members wait?"
)
JOINED_HINT = (
    "Rank {rank} joined #{seq} of group {group}: the group's other members went on after it, or "
    "finished it. The collective you want is one a member still waits in."
)
NOT_ENTERED_HINT = "No member of group {group} entered a collective #{seq}: their records end before it."
NOT_WAITED_HINT = (
    "No member of group {group} waits in #{seq}: what does each rank that wrote a record wait in "
    "(its last entry, or distlab_waiting where gloo's recorder leaves it out)?"
)


@dataclass(frozen=True)
class Hang:
    """What the course's analyzer reads from a folder of dumps."""

    world: tuple[int, ...]
    dumps: dict[int, dict]
    culprits: tuple[int, ...]  # ranks that did not join a collective others wait in
    collectives: tuple[Collective, ...]  # those collectives that carry a sequence number
    waiting: dict[int, Collective | None]  # each dumped rank's collective, None: in none


def world_ranks(dumps: dict[int, dict], folder: Path) -> tuple[int, ...]:
    """Every rank of the job: the default group's (pg_config, desc ``default_pg``), else hosts.json's."""
    for trace in dumps.values():
        for config in trace.get("pg_config", {}).values():
            if config.get("desc") == "default_pg":
                return tuple(json.loads(config["ranks"]))
    hosts = read_hosts(str(Path(folder) / "rank_"))
    return tuple(h["rank"] for h in hosts) or tuple(range(max(dumps) + 1))


def expected(folder: str | Path) -> Hang | None:
    """The course's reading of the dumps in ``folder`` (None: no dump there): hang_report's rules
    (``distlab.flight_recorder``), as data."""
    dumps = read_dumps(str(Path(folder) / "rank_"))
    if not dumps:
        return None
    world = world_ranks(dumps, Path(folder))
    waits = {rank: last_collectives(trace)[1] for rank, trace in dumps.items()}
    culprits, collectives = set(), {}
    for waiting in waits.values():
        if waiting is None:
            continue
        absent = [
            r
            for r in waiting.members
            if r not in dumps or (waits[r] is None and not joined(dumps[r], waiting))
        ]
        culprits |= set(absent)
        if absent and waiting.seq is not None:
            collectives[waiting.group, waiting.seq] = waiting
    return Hang(world, dumps, tuple(sorted(culprits)), tuple(collectives.values()), waits)


def _members(hang: Hang, group: str) -> tuple[tuple[int, ...], str] | None:
    """The ranks and description of a group named ``group``, from any dump's pg_config."""
    for trace in hang.dumps.values():
        config = trace.get("pg_config", {}).get(group)
        if config is not None:
            return tuple(json.loads(config["ranks"])), config.get("desc", "")
    return None


def _recorded(hang: Hang, group: str) -> list[int]:
    """Every sequence number the dumps hold for ``group``, the waited-in ones included."""
    seqs = [
        e["collective_seq_id"]
        for trace in hang.dumps.values()
        for e in trace["entries"]
        if e["process_group"][0] == group and not e.get("is_p2p")
    ]
    return seqs + [w.seq for w in hang.waiting.values() if w is not None and w.group == group and w.seq]


def _stopped_short(hang: Hang, rank: int) -> bool:
    """Whether another rank waits in a collective of ``rank`` that ``rank``'s record does not hold."""
    return any(
        w is not None and rank in w.members and not joined(hang.dumps[rank], w)
        for r, w in hang.waiting.items()
        if r != rank
    )


def _normalise(answer) -> tuple[int, str, int] | None:
    if not isinstance(answer, (tuple, list)) or len(answer) != 3:
        return None
    rank, group, seq = answer
    if isinstance(group, (tuple, list)) and group:  # an entry's process_group: (name, desc)
        group = group[0]
    try:
        return int(rank), str(group), int(seq)
    except (TypeError, ValueError):
        return None


def judge(find_hang: Callable, folder: str | Path) -> tuple[object, bool, str]:
    """(what to show of the answer, right?, hint): ``FIXME`` while the stub is untouched."""
    hang = expected(folder)
    try:
        answer = find_hang(folder)
    except Exception as exc:  # the learner's code: any error is an answer to explain
        return f"your function raised {type(exc).__name__}: {exc}", False, FORMAT_HINT
    if untouched(answer):
        return FIXME, False, ""
    found = _normalise(answer)
    if found is None:
        return f"it returned {answer!r}", False, FORMAT_HINT
    rank, group, seq = found
    said = f"rank {rank}, #{seq} of group {group}"
    if rank not in hang.world:
        return said, False, NOT_A_RANK_HINT.format(world=list(hang.world))
    if rank not in hang.culprits:
        if rank not in hang.dumps:
            return said, False, UNAWAITED_HINT.format(rank=rank)
        waiting = hang.waiting.get(rank)
        if waiting is not None and _stopped_short(hang, rank):
            return said, False, VICTIM_HINT.format(rank=rank, group=waiting.group)
        return said, False, ALIVE_HINT.format(rank=rank)
    if not hang.collectives:  # every survivor waits in an unnumbered transfer: the rank is the answer
        return f"rank {rank} (no numbered collective waits for it)", True, ""
    right = {(c.group, c.seq) for c in hang.collectives if rank in c.members}
    if (group, seq) in right:
        c = next(c for c in hang.collectives if (c.group, c.seq) == (group, seq))
        return (
            f"rank {rank} never joined {c.op} #{seq} of group {group} ({c.desc}) {list(c.members)}",
            True,
            "",
        )
    members = _members(hang, group)
    if members is None:
        return said, False, UNKNOWN_GROUP_HINT.format(group=group)
    ranks, desc = members
    if rank not in ranks:
        return said, False, NOT_A_MEMBER_HINT.format(group=group, desc=desc, members=list(ranks), rank=rank)
    recorded = _recorded(hang, group)
    if recorded and seq > max(recorded):
        return said, False, NOT_ENTERED_HINT.format(group=group, seq=seq)
    if any(g == group and seq < s for g, s in right):
        return said, False, JOINED_HINT.format(rank=rank, seq=seq, group=group)
    return said, False, NOT_WAITED_HINT.format(group=group, seq=seq)


def check_hang(find_hang: Callable, folder: str | Path, *, name: str = NAME) -> bool:
    """``check`` the learner's ``find_hang(folder)`` on the dumps in ``folder`` (:func:`judge`):
    ``[ok]`` with the collective, ``[not yet]`` while the stub is untouched or the folder holds no
    dump yet, ExerciseError with a hint otherwise."""
    if expected(folder) is None:
        print(f"[not yet] {name}: no flight records (rank_<N>) in {folder}: run the hang job first")
        progress.record(name, "not yet")
        return False
    answer, right, hint = judge(find_hang, folder)
    return check(name, answer, ok=lambda _: right, hint=hint)


__all__ = ["Hang", "check_hang", "expected", "judge", "world_ranks"]
