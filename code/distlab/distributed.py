"""One rank-discovery path for every launcher, and process-group start-up.

Contract: ``discover()`` returns who this process is, whatever started it:

=====================  ===========================================================
launcher               variables read
=====================  ===========================================================
torchrun / launch      RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT
mpirun (Open MPI)      OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
srun (one task/rank)   SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE
nothing                a single process: rank 0 of 1
=====================  ===========================================================

Launchers that do not export a rendezvous address (mpirun, srun) get ``MASTER_ADDR`` from the
first host of the job (``SLURM_JOB_NODELIST``, or the first line of PBS's ``$PBS_NODEFILE``, else
localhost) and ``MASTER_PORT`` from the job id (``SLURM_JOB_ID``, or the number in ``PBS_JOBID``),
so every rank of a job agrees without talking first. ``mpirun`` across nodes outside Slurm and PBS
(over ssh) has no job to ask: both must come from ``mpirun -x MASTER_ADDR=... -x MASTER_PORT=...``.

A half-set environment is refused with the fix, before any process group waits: some of a
launcher's variables without the others (``RANK`` without ``WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``
without ``_SIZE``), or an mpirun rank on another node that was not given the rendezvous address
(ranks on mpirun's own node inherit its shell's variables; the others see only what ``-x`` sends).

The backend follows the hardware: ``nccl`` when CUDA is present, else ``gloo``. Every process
group is created with a timeout, so a missing or dead rank fails the job with a message instead
of hanging it.

Restarts (``torchrun --max-restarts N``): each attempt starts its group in a fresh namespace of
torchrun's agent store (``distlab.torchrun_store``: why a restarted worker would otherwise hang),
and counts the attempts there (``DistContext.restart``).
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.rank_process import whole_line_stdout
from distlab.torchrun_store import agent_store_namespace, agent_store_serves

#: Seconds a collective may wait for a missing rank before the job fails.
DEFAULT_TIMEOUT_S = float(os.environ.get("DISTLAB_PG_TIMEOUT", "300"))


@dataclass(frozen=True)
class DistEnv:
    """Who this process is, as its launcher told it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "mpirun" | "srun" | "single"

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compact host list: ``"node[1-2,5],gpu01"`` -> ``[node1, node2, node5, gpu01]``."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", hostlist):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}")
    return hosts


def _tasks_on_first_node(spec: str) -> int:
    """``SLURM_STEP_TASKS_PER_NODE`` looks like ``"2(x2)"`` or ``"3,2"``: tasks on the first node."""
    return int(re.match(r"\d+", spec).group(0))


def _first_host(env: Mapping[str, str]) -> str | None:
    """The job's first node: Slurm's node list, else PBS's node file; None outside a job."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        return expand_hostlist(nodelist)[0]
    if env.get("PBS_NODEFILE"):
        hosts = Path(env["PBS_NODEFILE"]).read_text().split()
        if hosts:
            return hosts[0]
    return None


def _default_port(env: Mapping[str, str]) -> int:
    """20000 + job id mod 20000 (Slurm's id, or the number of PBS's ``1234.server``), else 29500."""
    match = re.match(r"\d+", env.get("SLURM_JOB_ID") or env.get("PBS_JOBID") or "")
    job = int(match.group(0)) if match else 0
    return 20000 + job % 20000 if job else 29500


#: Variables each launcher always sets together (a rank reads them all or none).
_TOGETHER = {
    "torchrun": ("RANK", "WORLD_SIZE"),
    "mpirun": tuple(f"OMPI_COMM_WORLD_{v}" for v in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")),
}


def _refuse_half_set(env: Mapping[str, str]) -> None:
    """Raise, naming the variables and the fix, when a launcher's variables are only partly set,
    or when mpirun's ranks span nodes outside Slurm and PBS without both rendezvous variables."""
    for launcher, names in _TOGETHER.items():
        given = [n for n in names if n in env]
        if given and len(given) < len(names):
            missing = [n for n in names if n not in env]
            raise ValueError(
                f"{launcher}'s variables are half set: {', '.join(f'{n}={env[n]}' for n in given)} without "
                f"{', '.join(missing)}; {launcher} sets all of them: start the script with {launcher}, or "
                f"unset the ones exported by hand"
            )
    if "OMPI_COMM_WORLD_RANK" not in env or _first_host(env) is not None:
        return
    world, local = int(env["OMPI_COMM_WORLD_SIZE"]), int(env["OMPI_COMM_WORLD_LOCAL_SIZE"])
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
    if local < world and missing:
        raise ValueError(
            f"mpirun started {world} ranks on several nodes ({local} on this one, rank "
            f"{env['OMPI_COMM_WORLD_RANK']}) outside Slurm and PBS, and this rank has no {' or '.join(missing)}: "
            f"ranks on other nodes see only what mpirun sends them; add -x MASTER_ADDR=<first host> "
            f"-x MASTER_PORT=<free port> to the mpirun line"
        )


def discover(env: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size and rendezvous address from the launcher's variables.

    Raises ValueError (with the fix) for a half-set environment: see the module docstring.
    """
    env = os.environ if env is None else env
    _refuse_half_set(env)
    addr = env.get("MASTER_ADDR") or _first_host(env) or "127.0.0.1"
    port = env.get("MASTER_PORT") or str(_default_port(env))
    if not port.isdigit():
        raise ValueError(f"MASTER_PORT={port!r} is not a port number: export a free TCP port, e.g. 29500")
    port = int(port)
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=addr,
            master_port=port,
            launcher="torchrun",
        )
    if "OMPI_COMM_WORLD_RANK" in env:
        return DistEnv(
            rank=int(env["OMPI_COMM_WORLD_RANK"]),
            world_size=int(env["OMPI_COMM_WORLD_SIZE"]),
            local_rank=int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
            local_world_size=int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1)),
            master_addr=addr,
            master_port=port,
            launcher="mpirun",
        )
    if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_STEP_NUM_TASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=_tasks_on_first_node(env.get("SLURM_STEP_TASKS_PER_NODE", "1")),
            master_addr=addr,
            master_port=port,
            launcher="srun",
        )
    return DistEnv(0, 1, 0, 1, addr, port, "single")


def pick_backend(requested: str | None = None) -> str:
    """``nccl`` with CUDA, else ``gloo``; an explicit request is honoured and checked."""
    if requested in (None, "", "auto"):
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in ("nccl", "gloo", "mpi"):
        raise ValueError(f"unknown distributed backend {requested!r}: choose nccl, gloo or mpi")
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA GPUs but none is visible: use --distributed-backend gloo")
    return requested


def pick_device(backend: str, local_rank: int) -> torch.device:
    """The device this rank computes on: its own GPU with nccl, the CPU otherwise."""
    if backend == "nccl":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass(frozen=True)
class DistContext:
    """A started process group: who we are, where we compute, how we talk, which attempt this is."""

    env: DistEnv
    backend: str
    device: torch.device
    #: Attempts of this job that torchrun started before this one (0: the first).
    restart: int = 0
    #: torchrun's ``--max-restarts`` (0 for other launchers).
    max_restarts: int = 0

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def init_distributed(
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: DistEnv | None = None,
) -> DistContext:
    """Start the default process group for this process (also for a world of one).

    Under torchrun, in a namespace of its agent's store that no earlier attempt used
    (``distlab.torchrun_store``: a restarted job would otherwise read its dead predecessors'
    addresses and hang); elsewhere env://, with rank 0 serving the store. Also makes stdout write
    whole lines (``distlab.rank_process.whole_line_stdout``): ranks share the job's log.
    """
    whole_line_stdout()
    env = env or discover()
    backend = pick_backend(backend)
    device = pick_device(backend, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    max_restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if not dist.is_initialized():
        # Ranks found in Slurm's, MPI's or PBS's variables are also exported as torchrun's, for
        # the libraries that read only those (DeepSpeed asserts LOCAL_RANK).
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        for name, value in (("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
                            ("LOCAL_WORLD_SIZE", env.local_world_size)):  # fmt: skip
            os.environ.setdefault(name, str(value))
        timeout = datetime.timedelta(seconds=timeout_s)
        rendezvous: dict = {"init_method": "env://"}
        if agent_store_serves(env.launcher, env.master_addr, env.master_port):
            agent = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)
            where = f"in torchrun's store at {env.master_addr}:{env.master_port}"
            token, restart = agent_store_namespace(
                dist.PrefixStore("distlab", agent), env.rank, env.world_size, timeout_s, where
            )
            rendezvous = {"store": dist.PrefixStore(f"distlab/{token}/group", agent)}
        dist.init_process_group(
            backend=backend,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            **rendezvous,
        )
    return DistContext(env=env, backend=backend, device=device, restart=restart, max_restarts=max_restarts)


def shutdown() -> None:
    """Destroy every process group now, while Python is still alive (if one was started).

    A gloo group's worker threads stop only when the last reference to the group goes. Objects
    in reference cycles (DeepSpeed's engine and ZeRO optimizer, parameters tagged with their
    group) would keep it alive into interpreter exit, where a worker that drops a tensor must
    take the GIL after finalisation began and the process aborts ("terminate called without an
    active exception", now and then, after a run that went well). So: collect the cycles first,
    and destroy through DeepSpeed where it started the groups, which also drops its own
    module-level references to them.
    """
    gc.collect()
    if not dist.is_initialized():
        return
    deepspeed_comm = sys.modules.get("deepspeed.comm")
    if deepspeed_comm is not None and deepspeed_comm.is_initialized():
        deepspeed_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
