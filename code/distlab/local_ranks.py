"""Ranks started on this machine: a free rendezvous port, torchrun's variables, a fork-server spawn.

Contract: ``spawn_ranks(fn, args, n)`` runs ``fn(i, *args)`` for i < n in fresh processes and fails
with a rank's traceback; ``torchrun_env(rank, world, port)`` is what torchrun would export to that
rank, so a process given it starts its group through ``distlab.distributed.init_distributed``.
Tests, benchmarks and the engine's local tools use these; cluster jobs start ranks with srun,
torchrun or mpirun instead.
"""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the kernel choose)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the fork server of :func:`spawn_ranks` imports once, so that no rank it starts pays for it
#: again (torch alone takes seconds of a core; ``torch._dynamo`` is imported by the first
#: ``torch.optim`` optimizer).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "distlab.distributed"]


def start_forkserver() -> None:
    """Start :func:`spawn_ranks`' fork server now and return at once: it imports
    :data:`FORKSERVER_PRELOAD` (seconds of a core) in the background, while the caller goes on (a
    notebook runs its jobs meanwhile), so that the first ``spawn_ranks`` does not wait for it."""
    from multiprocessing import forkserver

    mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    forkserver.ensure_running()


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """``mp.spawn`` from a fork server: ``fn(i, *args)`` for i < ``nprocs``, each in a fresh process
    forked from one that has imported :data:`FORKSERVER_PRELOAD` and computed nothing (so no thread
    pool is copied); a process that raises fails the call with its traceback. ``fn`` must be a
    module-level function (it is pickled by name), as for ``mp.spawn``."""
    mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts (the first call)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def torchrun_env(rank: int, world_size: int, port: int, addr: str = "127.0.0.1") -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of ``world_size`` processes on one node."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }
