"""Getting the ranks of a demo started: by a launcher, or spawned by the script itself.

Three ways to obtain N processes that can talk to each other:

==========================  =========================================================  ===========
how                         command                                                    nodes
==========================  =========================================================  ===========
the script spawns them      ``python demo.py --spawn 4``                               one
torchrun starts them        ``torchrun --standalone --nproc-per-node=4 demo.py``       one
srun starts one torchrun    ``srun torchrun --nnodes=2 --nproc-per-node=4 --rdzv-...`` many
per node                    (or ``mpirun -np 8 python demo.py``, or plain ``srun``)
==========================  =========================================================  ===========

Whichever made them, each process ends up knowing ``RANK``, ``WORLD_SIZE`` and where to meet
(``MASTER_ADDR:MASTER_PORT``); ``distlab.distributed.discover()`` reads that.

A script must not do both. Under ``torchrun --nproc-per-node=2 demo.py --spawn 2`` each of the
2 workers would start 2 children: 4 processes in 2 separate worlds that both claim ranks 0..1,
so everything runs twice, two processes share each GPU, and no world spans the nodes the
launcher was given (children that reused the launcher's MASTER_PORT would instead collide with
its rendezvous). :func:`check_spawn_allowed` refuses that before any process is started.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from collections.abc import Callable

import torch.multiprocessing as mp

from distlab.distributed import DistContext, discover, init_distributed
from distlab.local_ranks import free_port, torchrun_env
from distlab.rank_process import cap_cpu_threads, print_on


class LaunchError(ValueError):
    """A bad way of starting the script; :func:`run` prints it as one message and exits with 2."""


def check_spawn_allowed(nprocs: int, script: str = "this script") -> None:
    """Refuse ``--spawn`` when a launcher already started this process as one rank of many."""
    if nprocs < 2:
        raise LaunchError(
            f"--spawn {nprocs}: spawn at least 2 processes (a world of 1 has nobody to talk to)"
        )
    env = discover()
    if env.launcher == "torchrun" or env.world_size > 1:
        total = env.world_size * nprocs
        raise LaunchError(
            f"refusing to --spawn {nprocs}: this process is already rank {env.rank} of {env.world_size}, "
            f"started by {env.launcher}. Spawning here would make {env.world_size} x {nprocs} = {total} "
            f"processes in {env.world_size} separate worlds, each claiming ranks 0..{nprocs - 1}: every "
            f"result computed {env.world_size} times, processes sharing GPUs, no world spanning the "
            f"launcher's nodes. Choose one way: drop --spawn (the launcher already made the processes) "
            f"or run `python {script} --spawn {nprocs}` without a launcher."
        )


def require_world(min_size: int = 2, script: str = "this script") -> None:
    """Fail before any process group exists when the launcher gave fewer than ``min_size`` ranks."""
    env = discover()
    if env.world_size < min_size:
        raise LaunchError(
            f"{script} needs at least {min_size} processes but was started as {env.world_size} "
            f"(launcher: {env.launcher}). Start it with `python {script} --spawn {min_size}`, "
            f"`torchrun --standalone --nproc-per-node={min_size} {script}`, or srun + torchrun in a job."
        )


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """``--spawn N``, ``--backend`` and ``--timeout``: the options every demo script shares."""
    parser.add_argument(
        "--spawn",
        type=int,
        default=0,
        metavar="N",
        help="start N processes on this machine with torch.multiprocessing (no launcher)",
    )
    parser.add_argument(
        "--backend",
        default=os.environ.get("LAB_BACKEND", "auto"),
        help="nccl, gloo or auto (nccl when CUDA is visible); default $LAB_BACKEND",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds any collective may wait for a missing rank before failing",
    )


def _child(
    local_rank: int,
    main: Callable[[argparse.Namespace], None],
    args: argparse.Namespace,
    nprocs: int,
    port: int,
) -> None:
    # What torchrun would have exported, told by the parent instead.
    os.environ.update(torchrun_env(local_rank, nprocs, port), DISTLAB_SPAWNED="1")
    main(args)


def run(main: Callable[[argparse.Namespace], None], args: argparse.Namespace, script: str) -> None:
    """Run ``main(args)`` in every rank: spawned here when ``args.spawn``, else as launched.

    Launch mistakes (spawn under a launcher, a world of one) are printed as one message and the
    process exits with status 2 before any process group exists.
    """
    try:
        if args.spawn:
            check_spawn_allowed(args.spawn, script)
            port = free_port()
            print(
                f"spawning {args.spawn} processes on {socket.gethostname()}, rendezvous 127.0.0.1:{port}",
                flush=True,
            )
            mp.start_processes(
                _child,
                args=(main, args, args.spawn, port),
                nprocs=args.spawn,
                join=True,
                start_method="spawn",
            )
        else:
            require_world(2, script)
            main(args)
    except LaunchError as err:
        print(f"{script}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def start(args: argparse.Namespace) -> DistContext:
    """Start the default process group (with ``args.timeout``) and cap CPU threads; print a banner."""
    ctx = init_distributed(backend=None if args.backend == "auto" else args.backend, timeout_s=args.timeout)
    threads = cap_cpu_threads(ctx.env.local_world_size)
    launcher = "spawn" if os.environ.get("DISTLAB_SPAWNED") else ctx.env.launcher
    say(
        ctx,
        f"up: launcher={launcher} local_rank={ctx.env.local_rank} "
        f"backend={ctx.backend} device={ctx.device} {threads}",
    )
    return ctx


def say(ctx: DistContext, message: str) -> None:
    """Print one line prefixed ``[rank r/n host]`` in a single write, so ranks' lines never mix."""
    print_on(True, f"[rank {ctx.rank}/{ctx.world_size} {socket.gethostname()}] {message}")


def by_rank(lines: list[str]) -> list[str]:
    """Log lines ``[rank r/n host] ...`` sorted by r (stable: each rank's own order is kept)."""

    def key(line: str) -> int:
        m = re.search(r"\[rank (\d+)/", line)
        return int(m.group(1)) if m else -1

    return sorted(lines, key=key)
