"""Bandwidth of all_reduce, all_gather, reduce_scatter, broadcast, send/recv and our ring, nccl-tests style.

For each op and message size S (``--min-size`` .. ``--max-size``, x``--factor``): warm-up calls,
then timed calls within the time budget; rank 0 prints time per call, algbw = S / t and
busbw = algbw x factor(n) (see ``distlab.comm.bench``) and writes ``--out`` (CSV + JSON).

Launch:

    python code/bandwidth_bench.py --spawn 2 --time-budget 20 --out runs/bw/spawn.csv
    torchrun --standalone --nproc-per-node=2 code/bandwidth_bench.py --label intra --out runs/bw/intra.csv
    srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=$LAB_PROCS_PER_NODE \\
         --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID code/bandwidth_bench.py \\
         --label inter --out jobs/bw-inter.csv
    mpirun -np 4 python code/bandwidth_bench.py       # or: srun --ntasks=4 python ...

Backend: LAB_BACKEND or --backend (default: nccl when CUDA is visible, gloo otherwise).
Sizes and ops are checked, and the largest message against free memory, before anything starts.
"""

from __future__ import annotations

import argparse
import functools

from distlab.comm import bench, launch
from distlab.comm.collectives import parse_names
from distlab.distributed import discover, pick_backend, pick_device, shutdown
from distlab.rank_process import print_on


def main(args: argparse.Namespace) -> None:
    ctx = launch.start(args)
    try:
        nodes = max(1, ctx.world_size // max(1, ctx.env.local_world_size))

        report = functools.partial(print_on, ctx.is_main)  # rank 0 speaks for all (slowest rank's times)
        report(
            f"bench {args.label}: {ctx.world_size} ranks on {nodes} node(s), backend {ctx.backend}, "
            f"sizes {bench.human(args.sizes[0])} .. {bench.human(args.sizes[-1])}, "
            f"budget {args.time_budget:g} s, ops {','.join(args.ops)}"
        )
        rows = bench.sweep(
            args.ops,
            args.sizes,
            device=ctx.device,
            backend=ctx.backend,
            label=args.label,
            nodes=nodes,
            time_budget_s=args.time_budget,
            warmup=args.warmup,
            max_iters=args.iters,
            report=report,
        )
        if ctx.is_main:
            csv_path, json_path = bench.write_results(rows, args.out)
            report(f"bench {args.label}: wrote {csv_path} and {json_path}")
    finally:
        shutdown()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launch.add_launch_args(parser)
    parser.add_argument("--ops", default="all", help=f"'all' or a comma list of: {', '.join(bench.OPS)}")
    parser.add_argument("--min-size", default="1K", help="smallest message S, e.g. 1K")
    parser.add_argument("--max-size", default="4M", help="largest message S, e.g. 4M")
    parser.add_argument("--factor", type=int, default=4, help="size step: S, S x factor, ...")
    parser.add_argument("--time-budget", type=float, default=30.0, help="seconds for the whole sweep")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per point")
    parser.add_argument("--iters", type=int, default=20, help="most timed calls per point")
    parser.add_argument("--label", default="run", help="name of this run in the CSV and the plot")
    parser.add_argument("--out", default="runs/bandwidth/bench.csv", help="CSV path (JSON goes next to it)")
    args = parser.parse_args(argv)
    try:
        args.ops = parse_names(args.ops, bench.OPS)
        args.sizes = bench.message_sizes(
            bench.parse_size(args.min_size), bench.parse_size(args.max_size), args.factor
        )
        if args.time_budget <= 0 or args.warmup < 0 or args.iters < 1:
            raise ValueError(
                f"--time-budget {args.time_budget}, --warmup {args.warmup}, --iters {args.iters}: "
                "need a positive budget, warmup >= 0 and iters >= 1"
            )
        env = discover()
        backend = pick_backend(None if args.backend == "auto" else args.backend)
        device = pick_device(backend, env.local_rank)
        sharing = 1 if device.type == "cuda" else (args.spawn or env.local_world_size)
        bench.check_memory(args.sizes[-1], sharing, device)
    except ValueError as err:
        parser.error(str(err))
    return args


if __name__ == "__main__":
    launch.run(main, parse(), script="code/bandwidth_bench.py")
