"""Exposed gradient communication of data parallelism, with and without ``--overlap-grad-reduce``.

After the last backward of a step the optimizer waits for the dp all-reduce of the gradients
(``grad_buckets.GradBuckets.finish``); that wait is the *exposed* communication::

    no overlap:  [fwd bwd]...[fwd  bwd       ][all-reduce all buckets][opt]
    overlap:     [fwd bwd]...[fwd  bwd       ][wait][opt]
                                   [ar0][ar1]...[arN]     (bucket i starts when its last grad is ready)

The engine's GPT (``LocalBackend``, what ``pretrain_gpt.py`` runs) trains on random tokens: one
bucket without overlap (Megatron's layout), then a sweep of ``--ddp-bucket-size`` with overlap
(too small: many latencies; too large: nothing to overlap, one bucket starts last). Each step
starts from a barrier; printed are the medians over ``--steps`` steps of rank 0's forwards +
backwards and of the wait of the rank that waited least (the last one out of backward: its wait
holds no straggler, only communication). The variants take turns, so that a busy moment of a
shared machine hits all of them. On a CPU the all-reduce runs in gloo's threads and competes
with backward for the cores: what leaves the wait partly comes back in backward (``sum``).

    python benchmarks/bench_overlap.py --spawn 4                  # DP=4 on this machine (gloo, CPU)
    srun --ntasks-per-node=2 python benchmarks/bench_overlap.py   # DP=4 over 2 nodes x 2 tasks
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from distlab.comm import launch
from distlab.distributed import shutdown
from distlab.gpt.distributed.grad_buckets import assign_buckets
from distlab.gpt.layout import Layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training.training import LocalBackend, forward_backward
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.rank_process import print_on


def build(state: ParallelState, cfg: GPTConfig, bucket: int | None) -> LocalBackend:
    """The engine's back end on a fresh GPT: one bucket without overlap (``bucket`` None), else
    ``--overlap-grad-reduce --ddp-bucket-size bucket``."""
    model = GPTModel(cfg, state)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return LocalBackend(
        model, opt, state, clip_grad=1.0, overlap_grad_reduce=bucket is not None, bucket_size=bucket
    )


def timed_step(backend: LocalBackend, batches: list) -> tuple[float, float]:
    """One step from a barrier; (forwards and backwards, exposed wait after them) in ms, the wait
    of the rank that waited least: the last to finish backward, which waits for no straggler,
    only for the communication its backward did not hide."""
    backend.zero_grad()
    dist.barrier()
    t0 = time.perf_counter()
    forward_backward(backend.module, batches, backward=backend.backward)
    t1 = time.perf_counter()
    backend.grad_buckets.finish()  # the exposed part: what backward did not hide
    t2 = time.perf_counter()
    backend.optimizer.step()
    wait = torch.tensor([t2 - t1])
    dist.all_reduce(wait, op=dist.ReduceOp.MIN)
    return 1e3 * (t1 - t0), 1e3 * float(wait)


def main(args: argparse.Namespace) -> None:
    ctx = launch.start(args)
    try:
        state = ParallelState.build(Layout(ctx.world_size))
        cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                        vocab_size=args.vocab, max_position_embeddings=args.seq)  # fmt: skip
        n = sum(p.numel() for p in GPTModel(cfg).parameters())
        print_on(ctx.is_main, f"DP={state.dp}, {ctx.backend}: {n:,} parameters ({4 * n / 2**20:.1f} MiB of fp32 "
                 f"gradients per all-reduce), m={args.micro_batches} micro-batches of {args.micro_batch} x "
                 f"{args.seq} tokens")  # fmt: skip
        print_on(
            ctx.is_main,
            f"{'variant':<28}{'buckets':>8}{'fwd+bwd ms':>12}{'exposed ms':>12}{'vs none':>9}{'sum ms':>9}",
        )
        sizes = [None, *args.bucket_sizes]
        backends = [build(state, cfg, size) for size in sizes]
        g = torch.Generator().manual_seed(state.rank)
        tokens = torch.randint(
            0, args.vocab, (args.micro_batches, args.micro_batch, args.seq + 1), generator=g
        )
        batches = [(t[:, :-1], t[:, 1:]) for t in tokens]  # m x (b, T)
        times: list[list[tuple[float, float]]] = [[] for _ in sizes]
        for step in range(args.steps + 1):  # variants in turn, so that a busy moment hits all of them
            for i, backend in enumerate(backends):
                t = timed_step(backend, batches)
                if step:  # the first warms up gloo's connections and the allocator
                    times[i].append(t)
        base = statistics.median(w for _, w in times[0])
        for size, backend, ts in zip(sizes, backends, times, strict=True):
            compute, exposed = (statistics.median(x) for x in zip(*ts, strict=True))
            name = "no overlap (1 bucket)" if size is None else f"overlap, bucket {size:,}"
            print_on(ctx.is_main, f"{name:<28}{len(backend.grad_buckets.buckets):>8}{compute:>12.1f}{exposed:>12.1f}"
                     f"{exposed / base:>9.2f}{compute + exposed:>9.1f}")  # fmt: skip
    finally:
        shutdown()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launch.add_launch_args(parser)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument(
        "--micro-batches", type=int, default=2, help="m: the overlap is in the last one's backward"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (median reported)")
    parser.add_argument(
        "--bucket-sizes",
        default="100000,400000,1600000,100000000",
        help="elements, comma-separated (overlap runs)",
    )
    args = parser.parse_args(argv)
    args.bucket_sizes = [int(float(s)) for s in args.bucket_sizes.split(",")]
    for s in args.bucket_sizes:
        assign_buckets([], s)  # refuses a size <= 0 before any process starts
    return args


if __name__ == "__main__":
    launch.run(main, parse(), "bench_overlap.py")
