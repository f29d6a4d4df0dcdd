"""Point-to-point messages between real processes: blocking send/recv, then isend/irecv.

Every rank sends ``[100 r, 100 r + 1, 100 r + 2]`` to rank r + 1 and receives from rank r - 1
(see ``distlab.comm.p2p``). Each rank prints what it sent and got.

Launch (every way gives the same output, only the hosts differ):

    python code/p2p_demo.py --spawn 2                                   # spawned here, one node
    torchrun --standalone --nproc-per-node=2 code/p2p_demo.py           # torchrun, one node
    srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=$LAB_PROCS_PER_NODE \\
         --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID code/p2p_demo.py   # nodes
    mpirun -np 4 python code/p2p_demo.py          # or: srun --ntasks=4 python code/p2p_demo.py

Environment: LAB_BACKEND (gloo/nccl, default: nccl when CUDA is visible), DISTLAB_PG_TIMEOUT.
Not both: ``torchrun ... p2p_demo.py --spawn 2`` is refused before anything starts.
"""

from __future__ import annotations

import argparse

from distlab.comm import launch, p2p
from distlab.distributed import shutdown


def main(args: argparse.Namespace) -> None:
    ctx = launch.start(args)
    try:
        p2p.blocking_shift(ctx)
        p2p.nonblocking_shift(ctx, delay_s=args.delay)
    finally:
        shutdown()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launch.add_launch_args(parser)
    parser.add_argument(
        "--delay",
        type=float,
        default=0.5,
        help="seconds each rank waits before its isend (so irecv is seen unfinished)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    launch.run(main, parse(), script="code/p2p_demo.py")
