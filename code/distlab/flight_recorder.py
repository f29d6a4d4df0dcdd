"""PyTorch's flight recorder on gloo as on NCCL, and who a hang waits for.

The flight recorder is a ring buffer, per rank, of the last ``TORCH_FR_BUFFER_SIZE`` collectives
the rank entered: operation, process group, the group's sequence number, input and output sizes,
whether it finished, and a Python stack. A hang is a collective that some rank never joins: rank r
is missing from sequence number k of group g when the other members recorded k and r did not.
PyTorch's analyzer (``torchfrtrace DIR``, ``torch.distributed.flight_recorder``) reads one file
per rank, ``<prefix><rank>``, each a pickle of ``torch._C._distributed_c10d._dump_fr_trace()``.

On NCCL the watchdog writes those files itself (``TORCH_NCCL_DUMP_ON_TIMEOUT``, to
``TORCH_FR_DUMP_TEMP_FILE<rank>``; ``distlab.nccl_dumps`` arms it). torch 2.14 records gloo's
collectives too, but on a gloo timeout nobody writes a dump, and a gloo dump's ``pg_config`` names
one unnamed group only (the analyzer then fails with a KeyError). This module fills both gaps:

    start(prefix, device)  collective, after every group exists: every rank's node, pid and GPU
                         (``distlab.rank_identity``), each rank's written as its start record;
                         rank 0 first removes an earlier run's dumps and records
    waiting_in(exc)      the collective a timed-out call waited in, from its traceback
    dump(prefix, rank, hosts, waiting)  this rank's record, with ``pg_config`` rebuilt from torch's own
                         table of groups (name, description, ranks), as ``<prefix><rank>``, and
                         the hosts as ``hosts.json``
    wait_for_dumps       the survivors' dumps, until all ranks or a grace period
    world_size           the job's ranks, from the groups' records in the dumps (``pg_config``)
    hang_report          from the dumps: ranks that wrote none (frozen, dead, or still computing),
                         the collective each missing rank did not join, each rank's last collective

gloo's recorder also lists no point-to-point operation, and marks a timed-out collective finished
or leaves it out: each dump therefore carries what its rank was waiting in, read from the exception
(:func:`waiting_in`; the pipeline's transfers say their peers), under the key ``distlab_waiting``,
which the analyzer ignores.

A frozen rank (SIGSTOP, a deadlock in native code, a dead node) writes no dump: the analyzer then
says "Missing dump files from ranks {r}" (``--allow-incomplete-ranks`` for the rest) and
:func:`hang_report` names r and the collective its group waits in.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import nccl_dumps, rank_identity

#: Collectives kept per rank when the environment does not say (a few iterations of the engine's).
DEFAULT_BUFFER_SIZE = 2000
HOSTS = "hosts.json"


def enable(entries: int = DEFAULT_BUFFER_SIZE) -> None:
    """Turn the recorder on (``TORCH_FR_BUFFER_SIZE``) unless the environment sets it; before the
    first process group."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))


def dump_prefix(environ: dict[str, str] | None = None) -> str:
    """``TORCH_FR_DUMP_TEMP_FILE`` (or its older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``), else
    ``./flight_recorder_<SLURM_JOB_ID>/rank_`` (``./flight_recorder/rank_`` outside Slurm): dump
    files are ``<prefix><rank>``."""
    env = os.environ if environ is None else environ
    if (given := nccl_dumps.user_prefix(env)) is not None:
        return given
    job = env.get("SLURM_JOB_ID")
    return str(Path.cwd() / (f"flight_recorder_{job}" if job else "flight_recorder") / "rank_")


def start(prefix: str, device: torch.device | None = None) -> list[dict]:
    """Collective: every rank's node, pid and, on ``device`` of type cuda, GPU UUID and PCI bus id
    (for the report, ``py-spy dump --pid`` and draining a device); rank 0 first removes an earlier
    run's dumps and start records from the folder. On NCCL each rank then writes its own start record
    (``started_<rank>.json``): there the watchdog writes the dumps and ends the process, so no Python
    runs at the hang. On gloo the engine's own dump writes the list (``hosts.json``), so a run that
    does not hang leaves no folder. The dumps come only with a hang."""
    folder = Path(prefix).parent
    if not dist.is_initialized():
        return []
    if dist.get_rank() == 0 and folder.is_dir():
        stale = [*folder.glob(Path(prefix).name + "*"), *folder.glob(rank_identity.PATTERN), folder / HOSTS]
        for old in stale:
            old.unlink(missing_ok=True)
    hosts: list = [None] * dist.get_world_size()
    me = rank_identity.identity(dist.get_rank(), device)
    dist.all_gather_object(hosts, me)  # after rank 0's clean-up: no record of this run is removed
    if dist.get_backend() == "nccl":
        rank_identity.record(folder, me)
    return hosts


def pg_config() -> dict[str, dict[str, str]]:
    """Every process group this rank knows, as the analyzer reads it: name -> name, desc, ranks."""
    world = dist.distributed_c10d._world
    config = {}
    for pg, name in world.pg_names.items():
        ranks = sorted(world.pg_group_ranks.get(pg, {}))
        config[name] = {"name": name, "desc": getattr(pg, "group_desc", "undefined"), "ranks": str(ranks)}
    return config


def waiting_in(exc: BaseException) -> dict | None:
    """The collective a failed call waited in, from the exception's traceback: the outermost frame of
    ``torch.distributed.distributed_c10d`` that has a ``group`` (the public call: ``all_reduce``,
    ``broadcast``, ...), its group and tensor sizes, and the innermost frame of distlab's own code.
    gloo's recorder does not always list the operation that timed out; this does. None: no such frame."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    calls = [
        f for f in frames if f.f_code.co_filename.endswith("distributed_c10d.py") and "group" in f.f_locals
    ]
    if not calls:
        return None
    call = calls[0]
    group = call.f_locals["group"] or dist.distributed_c10d._get_default_group()
    tensors = [call.f_locals.get(k) for k in ("tensor", "input_tensor", "output_tensor", "input", "output")]
    sizes = [list(t.shape) for t in tensors if isinstance(t, torch.Tensor)][:1]
    ours = [f for f in frames if "/distlab/" in f.f_code.co_filename]
    at = (
        f" at {Path(ours[-1].f_code.co_filename).name}:{ours[-1].f_lineno} ({ours[-1].f_code.co_name})"
        if ours
        else ""
    )
    return {
        "op": f"{dist.get_backend(group)}:{call.f_code.co_name}",
        "at": at,
        "group": dist.distributed_c10d._world.pg_names[group],
        "members": dist.get_process_group_ranks(group),
        "sizes": sizes,
    }


def _sequence_number(entries: list[dict], waiting: dict) -> int:
    """The group's sequence number of the collective :func:`waiting_in` found. gloo's recorder (torch
    2.14) sometimes lists a timed-out collective, marked finished like the others, and sometimes not
    at all: the group's last entry is it when operation and sizes match, else it is the next number.
    (Two calls in a row with the same operation and sizes, the second unlisted, would read one low.)"""
    mine = [e for e in entries if e["process_group"][0] == waiting["group"] and not e.get("is_p2p")]
    if not mine:
        return 1
    last = mine[-1]
    same = waiting["op"] == last["profiling_name"] and last["input_sizes"] == waiting["sizes"]
    return last["collective_seq_id"] if same else last["collective_seq_id"] + 1


def dump(prefix: str, rank: int, hosts: list[dict], waiting: dict | None = None) -> Path:
    """Write this rank's record as ``<prefix><rank>`` and :func:`start`'s hosts as ``hosts.json``
    (each atomically: a reader never sees half a file). ``waiting``: the transfer this rank waits
    in when the recorder does not list it (gloo's point-to-point ops): op, group, members, sizes;
    kept under the key ``distlab_waiting``, which PyTorch's analyzer ignores."""
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    trace["pg_config"] = pg_config()
    if waiting is not None and waiting.get("group") in trace["pg_config"]:
        waiting = {**waiting, "seq": _sequence_number(trace["entries"], waiting)}
    trace["distlab_waiting"] = waiting
    target = Path(prefix + str(rank))
    target.parent.mkdir(parents=True, exist_ok=True)
    for path, data in ((target, pickle.dumps(trace)), (target.parent / HOSTS, json.dumps(hosts).encode())):
        partial = target.parent / f".writing-{rank}.tmp"
        partial.write_bytes(data)
        partial.replace(path)
    return target


def read_dumps(prefix: str) -> dict[int, dict]:
    """rank -> its unpickled record, for every ``<prefix><rank>`` file there is."""
    base = Path(prefix)
    found = {}
    for path in base.parent.glob(base.name + "*"):
        suffix = path.name[len(base.name) :]
        if suffix.isdigit():
            found[int(suffix)] = pickle.loads(path.read_bytes())
    return found


def read_hosts(prefix: str) -> list[dict]:
    """Every rank's start record in the dumps' folder (``started_<rank>.json``), else the
    ``hosts.json`` that :func:`dump` writes, else []."""
    folder = Path(prefix).parent
    if records := rank_identity.read(folder):
        return [records[rank] for rank in sorted(records)]
    path = folder / HOSTS
    return json.loads(path.read_text()) if path.exists() else []


def find_prefix(folder: Path, default: str = "rank_") -> str:
    """The dumps' common file-name prefix in ``folder`` (``rank_``, NCCL's ``nccl_trace_rank_``,
    ...), as PyTorch's analyzer infers it: the one stem of the names that end in a number."""
    stems = {m.group(1) for p in folder.iterdir() if (m := re.fullmatch(r"([\w\-]*?)(\d+)", p.name))}
    return stems.pop() if len(stems) == 1 else default


def world_size(dumps: dict[int, dict], hosts: list[dict] = ()) -> int:
    """How many ranks the job had: one past the highest rank that any group's record names
    (``pg_config``: the default group lists them all), any dump or any start record."""
    ranks = {*dumps, *(h["rank"] for h in hosts)}
    for trace in dumps.values():
        for config in trace.get("pg_config", {}).values():
            ranks.update(json.loads(config.get("ranks") or "[]"))
    return max(ranks) + 1 if ranks else 0


def wait_for_dumps(prefix: str, world_size: int, grace_s: float) -> dict[int, dict]:
    """The dumps present once all ``world_size`` ranks wrote theirs or ``grace_s`` passed."""
    deadline = time.monotonic() + grace_s
    while len(found := read_dumps(prefix)) < world_size and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


@dataclass(frozen=True)
class Collective:
    """One flight-recorder entry: ``gloo:all_reduce #12 of group 3 (tp) [0, 1], sizes [[4, 8]]``."""

    op: str
    group: str
    desc: str
    members: tuple[int, ...]
    seq: int | None  # None: an op the recorder does not number (dump's ``waiting``)
    sizes: list
    retired: bool
    at: str = ""  # where the engine called it (dump's ``waiting``): " at clip_grads.py:51 (grad_norm)"

    @classmethod
    def of(cls, entry: dict, config: dict) -> Collective:
        name, desc = entry["process_group"]
        members = tuple(json.loads(config.get(name, {}).get("ranks", "[]")))
        seq = entry["p2p_seq_id"] if entry.get("is_p2p") else entry["collective_seq_id"]
        return cls(entry["profiling_name"], name, desc, members, seq, entry["input_sizes"], entry["retired"])

    def __str__(self) -> str:
        members = ", ".join(map(str, self.members))
        seq = "" if self.seq is None else f" #{self.seq}"
        return f"{self.op}{seq} of group {self.group} ({self.desc}) [{members}], sizes {self.sizes}{self.at}"


def last_collectives(trace: dict) -> tuple[Collective | None, Collective | None]:
    """(the last finished collective, the unfinished one the rank waits in) of one record: the
    recorder's first unfinished entry (NCCL enqueues later collectives behind a stuck one), else
    what the engine saw it wait in (``distlab_waiting``)."""
    entries = [Collective.of(e, trace["pg_config"]) for e in trace["entries"]]
    waiting = next((c for c in entries if not c.retired), None)
    if waiting is None and trace.get("distlab_waiting"):
        w = trace["distlab_waiting"]
        desc = trace["pg_config"].get(w["group"], {}).get("desc", w["group"])
        waiting = Collective(
            w["op"], w["group"], desc, tuple(w["members"]), w.get("seq"), w["sizes"], False, w.get("at", "")
        )
    done = [c for c in entries if c.retired and not _same_or_later(c, waiting)]
    return (done[-1] if done else None), waiting


def _same_or_later(c: Collective, waiting: Collective | None) -> bool:
    """The waited-in collective itself, which gloo's recorder may list as finished."""
    return (
        waiting is not None and waiting.seq is not None and c.group == waiting.group and c.seq >= waiting.seq
    )


def joined(trace: dict, collective: Collective) -> bool:
    """Whether a rank's record holds ``collective`` (its group's sequence number, or a later one);
    an operation the recorder does not number counts as joined."""
    if collective.seq is None:
        return True
    entries = (Collective.of(e, trace["pg_config"]) for e in trace["entries"])
    return any(c.group == collective.group and c.seq is not None and c.seq >= collective.seq for c in entries)


def hang_report(dumps: dict[int, dict], world_size: int, hosts: list[dict]) -> tuple[list[int], list[str]]:
    """(the ranks that wrote no dump, the report's lines): for each collective a survivor waits in,
    the members that did not join it and where they run (a rank without a dump, or one that dumped
    while in no collective: it skipped this one; a rank waiting in another collective is not named,
    it waits for someone else); then each rank's last finished collective and the one it waits in."""
    node = {h["rank"]: rank_identity.where(h) for h in hosts}
    missing = sorted(set(range(world_size)) - set(dumps))
    lines, named = [], set()
    waits = {rank: last_collectives(trace) for rank, trace in sorted(dumps.items())}
    for _, waiting in waits.values():
        absent = [
            r
            for r in (waiting.members if waiting else ())
            if r not in dumps or (waits[r][1] is None and not joined(dumps[r], waiting))
        ]
        if waiting is None or not absent or (waiting.group, waiting.seq, waiting.members) in named:
            continue
        named.add((waiting.group, waiting.seq, waiting.members))
        where = "; ".join(f"rank {r} on {node.get(r, '?')}" for r in absent)
        lines.append(f"> hang: ranks [{', '.join(map(str, absent))}] did not join {waiting}: {where}")
    for rank in range(world_size):
        if rank in missing:
            lines.append(f"> hang: rank {rank} on {node.get(rank, '?')}: wrote no flight record")
            continue
        done, waiting = waits[rank]
        where = str(waiting) if waiting else "no recorded collective"
        lines.append(f"> hang: rank {rank} on {node.get(rank, '?')}: last finished {done}; waits in {where}")
    return missing, lines


__all__ = [
    "Collective",
    "dump",
    "dump_prefix",
    "enable",
    "find_prefix",
    "hang_report",
    "joined",
    "last_collectives",
    "pg_config",
    "read_dumps",
    "read_hosts",
    "start",
    "wait_for_dumps",
    "waiting_in",
    "world_size",
]
