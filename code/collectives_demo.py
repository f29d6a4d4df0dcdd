"""Every collective of torch.distributed on small tensors, then the hand-written ring all-reduce.

Rank r starts from ``x(r) = [10 r + 1, 10 r + 2]``; each rank prints its own result and checks
it against what it must be (``distlab.comm.collectives.expected``): ``ok`` or ``WRONG``.
``subgroups`` repeats all_reduce and all_gather on ``new_group`` groups of even and odd ranks;
``ring_all_reduce`` compares ``distlab.comm.ring.ring_all_reduce`` with ``dist.all_reduce`` for
the lengths of ``--ring-lengths`` (any length, divisible by the world size or not).

Launch:

    python code/collectives_demo.py --spawn 4
    torchrun --standalone --nproc-per-node=4 code/collectives_demo.py --collectives all_reduce,ring_all_reduce
    srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=$LAB_PROCS_PER_NODE \\
         --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID code/collectives_demo.py
    mpirun -np 4 python code/collectives_demo.py      # or: srun --ntasks=4 python ...

``--hang-rank R --timeout 10``: rank R stays alive but never joins; the others fail after 10 s
with a timeout message instead of waiting forever (the process-group timeout at work).
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist

from distlab.comm import collectives as col
from distlab.comm import launch
from distlab.comm.ring import ring_all_reduce
from distlab.distributed import DistContext, shutdown

NAMES = [*col.DEMOS, "subgroups", "ring_all_reduce"]


def _fmt(t: torch.Tensor | None) -> str:
    return "(no result on this rank)" if t is None else str(t.tolist())


def run_demo(ctx: DistContext, name: str, group=None, tag: str = "") -> None:
    """Run one demo on ``group``, print this rank's result and whether it is right."""
    rank = dist.get_rank(group)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(ctx.world_size))
    outputs = col.DEMOS[name](ctx.device, group)
    wanted = col.expected(name, rank, members)
    for label, out in outputs.items():
        want = wanted[label]
        title = f"{tag}{name}" + (f"({label})" if label and name != "barrier" else "")
        if name == "barrier":
            launch.say(
                ctx,
                f"{title}: arrived {col.BARRIER_DELAY_S * rank:.1f} s late, waited "
                f"{out.item():.2f} s (about {want.item():.2f} s expected)",
            )
            continue
        ok = (out is None and want is None) or (
            out is not None and want is not None and torch.equal(out.cpu(), want)
        )
        launch.say(ctx, f"{title} -> {_fmt(out)}  {'ok' if ok else f'WRONG, expected {_fmt(want)}'}")


def run_subgroups(ctx: DistContext, timeout_s: float) -> None:
    evens, odds = col.even_odd_groups(ctx.world_size, datetime.timedelta(seconds=timeout_s))
    mine, which = (evens, "even") if ctx.rank % 2 == 0 else (odds, "odd")
    members = dist.get_process_group_ranks(mine)
    launch.say(
        ctx, f"subgroup {which} ranks {members}: I am rank {dist.get_rank(mine)} of {len(members)} in it"
    )
    for name in ("all_reduce", "all_gather"):
        run_demo(ctx, name, group=mine, tag=f"[{which} group] ")


def run_ring(ctx: DistContext, lengths: list[int]) -> None:
    for i, length in enumerate(lengths):
        gen = torch.Generator().manual_seed(1000 + ctx.rank)
        x = torch.randint(-50, 50, (length,), generator=gen).float().to(ctx.device)  # (length,)
        ref = x.clone()
        dist.all_reduce(ref)
        trace = (lambda line: launch.say(ctx, f"ring trace: {line}")) if i == 0 and ctx.rank == 0 else None
        ring_all_reduce(x, trace=trace)
        chunks = [c.numel() for c in torch.tensor_split(x, ctx.world_size)]
        diff = (x - ref).abs().max().item() if length else 0.0
        verdict = "ok" if torch.equal(x, ref) else "WRONG"
        launch.say(
            ctx,
            f"ring_all_reduce len={length} chunks={chunks}: "
            f"max |ring - dist.all_reduce| = {diff:g}  {verdict}",
        )


def main(args: argparse.Namespace) -> None:
    ctx = launch.start(args)
    try:
        if ctx.rank == args.hang_rank:
            launch.say(ctx, f"--hang-rank {ctx.rank}: staying alive but not joining any collective")
            time.sleep(3 * args.timeout)
            return
        launch.say(ctx, f"my x = {col.x_of(ctx.rank).tolist()}")
        for name in args.names:
            try:
                if name == "subgroups":
                    run_subgroups(ctx, args.timeout)
                elif name == "ring_all_reduce":
                    run_ring(ctx, args.ring_lengths)
                else:
                    run_demo(ctx, name)
            except RuntimeError as err:  # a missing rank: report it in one line, fail the job
                first = str(err).strip().splitlines()[0][:200]
                launch.say(ctx, f"{name} failed after waiting up to {args.timeout:g} s: {first}")
                raise SystemExit(1) from None
    finally:
        shutdown()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launch.add_launch_args(parser)
    parser.add_argument("--collectives", default="all", help=f"'all' or a comma list of: {', '.join(NAMES)}")
    parser.add_argument("--ring-lengths", default="1,3,7,1001", help="tensor lengths for ring_all_reduce")
    parser.add_argument("--hang-rank", type=int, default=-1, help="this rank never joins (timeout demo)")
    args = parser.parse_args(argv)
    try:
        args.names = col.parse_names(args.collectives, NAMES)
        args.ring_lengths = [int(s) for s in args.ring_lengths.split(",")]
    except ValueError as err:
        parser.error(str(err))
    if any(n < 0 for n in args.ring_lengths):
        parser.error(f"--ring-lengths {args.ring_lengths}: lengths must be >= 0")
    return args


if __name__ == "__main__":
    launch.run(main, parse(), script="code/collectives_demo.py")
