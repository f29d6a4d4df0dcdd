"""The local cluster's hardware figures, measured here in a few seconds.

Notebook 04 measures the GEMM peak a job's ranks can reach (``training/flops.measure_gemm_tflops``:
large fp32 matrix products with the threads a rank computes with); notebook 02 times collectives
over gloo and reports nccl-tests' bus bandwidth (``distlab.comm.bench``). :func:`measure_local`
does both at a smaller scale: the GEMM rate of one rank's threads; a sweep of the collectives the
step model prices (all-reduce, all-gather, reduce-scatter, all-to-all, send/recv) among ``ranks``
spawned gloo ranks from 1 KiB to 16 MiB, kept whole in the link (:func:`measure_link`; alpha and a
bus bandwidth from its ends, for other group sizes); an fp32 exp, softmax's kernel, and a copy
(:func:`measure_kernel`: the unfused passes' and the optimizer's rates). Both nodes of the course's
cluster are this machine (loopback), so one link serves inside and between "nodes".

A CPU step of a small model stays far below the GEMM rate (small matrices, attention, the Python
around them): :func:`calibrate` takes the fraction of that rate a step reaches from one measured
layout (its step minus the predicted communication), and the other layouts are predicted with it
(``benchmarks/bench_step_model.py --local``, notebook 13).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from distlab.comm.bench import BUS_FACTOR, make_op, time_op
from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.memory.memory_estimate import MemorySetup, stage_parameters
from distlab.gpt.planning.hardware import Hardware, Link
from distlab.gpt.planning.step_model import StepPrediction, predict_step
from distlab.gpt.tensor_parallel.layers import pad_vocab_size
from distlab.gpt.training.flops import measure_gemm_tflops
from distlab.local_ranks import free_port, spawn_ranks

#: Bytes of the swept collectives, 1 KiB to 16 MiB by 4 (the local layouts' messages: 2 KiB of a loss
#: all-reduce to 17 MB of the tiny GPT's gradients), and what each sweeps in the step model's names.
SIZES = [2**10 * 4**i for i in range(8)]
SWEPT = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "send": "sendrecv",
}
TINY, BLOCK = 16, 2**16  # fp32 elements of the exps that give a kernel's latency and the bandwidth
STREAM = 2**22  # fp32 elements of the copy that gives the memory bandwidth (16 MiB: out of the caches)


def _all_to_all(count: int):
    import torch.distributed as dist

    out, inp = torch.zeros(count), torch.zeros(count)
    return lambda: dist.all_to_all_single(out, inp)


def _time_collectives(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from distlab.local_ranks import torchrun_env

    os.environ.update(torchrun_env(rank, world, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        cpu, times = torch.device("cpu"), {}
        for name, op in [*SWEPT.items(), ("all_to_all", None)]:
            calls = [make_op(op, n // 4, cpu) if op else _all_to_all(n // 4) for n in SIZES]
            # the median of three rounds: one slow round (another process ran) must not set a price
            times[name] = [
                (n, statistics.median(time_op(call, cpu, 1, 20, 0.02)[0] for _ in range(3)))
                for n, call in zip(SIZES, calls, strict=True)
            ]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def measure_link(ranks: int = 2) -> Link:
    """A gloo sweep among ``ranks`` local processes: all-reduce, all-gather, reduce-scatter,
    all-to-all and send/recv at :data:`SIZES` (the link's ``measured`` points, each the median of
    three rounds of up to 20 calls); alpha is the smallest all-reduce's time, the bus bandwidth
    that of the largest after alpha."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "times.json"))
        spawn_ranks(_time_collectives, (ranks, free_port(), out), ranks)
        times = json.loads(Path(out).read_text())
    (_, alpha), *_, (large, t) = times["all_reduce"]
    bandwidth = BUS_FACTOR["all_reduce"](ranks) * large / max(t - alpha, 1e-9)
    return Link(bandwidth, alpha, ranks, {op: tuple((b, s) for b, s in pts) for op, pts in times.items()})


def measure_kernel(kernel: str = "exp", threads: int = 1, repeats: int = 200) -> Link:
    """Latency and bandwidth (bytes read + written per second) of one out-of-place fp32 kernel
    with ``threads`` threads, the median time on :data:`TINY` elements its latency: ``"exp"`` on
    :data:`BLOCK` elements (a (2, 8, 64, 64) score block, 256 KiB; softmax's kernel, bound by its
    arithmetic here), or ``"copy"`` on :data:`STREAM` (16 MiB, out of the caches: memory's rate).
    Bandwidth = 8 elements / (time - latency)."""
    large = {"exp": BLOCK, "copy": STREAM}[kernel]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for n in (TINY, large):
            x, y = torch.randn(n), torch.empty(n)
            call = partial(torch.exp, x, out=y) if kernel == "exp" else partial(y.copy_, x)
            call()  # warm-up
            runs = []
            for _ in range(repeats if n < STREAM else repeats // 10):
                start = time.perf_counter()
                call()
                runs.append(time.perf_counter() - start)
            times.append(statistics.median(runs))
    finally:
        torch.set_num_threads(previous)
    small, block = times
    return Link(bandwidth=8 * large / max(block - small, 1e-9), latency=small)


def measure_local(ranks_per_node: int = 2, threads_per_rank: int = 1, memory_gib: float = 4.0) -> Hardware:
    """The local cluster as :class:`Hardware`: one rank's GEMM rate (fp32, ``threads_per_rank``
    threads; achieved fraction 1 of it), the all-reduce link of ``ranks_per_node`` ranks for both
    links (with their sweep), no flash attention (the engine's CPU attention computes the whole
    s x s products), an exp's and a copy's rates (:func:`measure_kernel`)."""
    tflops = measure_gemm_tflops(torch.device("cpu"), size=512, min_time_s=0.1, threads=threads_per_rank)
    link = measure_link(ranks_per_node)
    return Hardware(
        name=f"local cluster: {ranks_per_node} ranks per node, {threads_per_rank} thread(s) each (measured)",
        gpus_per_node=ranks_per_node,
        peak_flops=tflops * 1e12,
        achieved_fraction=1.0,
        memory_bytes=memory_gib * 2**30,
        intra_node=link,
        inter_node=link,
        flash_attention=False,
        source="measured by planning/local_cluster.measure_local",
        elementwise=measure_kernel("exp", threads_per_rank),
        memory=measure_kernel("copy", threads_per_rank),
    )


def predict_run(argv: list[str], hw: Hardware, world: int = 2) -> StepPrediction:
    """The step of ``pretrain_gpt.py argv`` on ``world`` ranks of ``hw`` (the largest stage's
    parameters from the estimator's count; plain DDP or the distributed optimizer as argv says)."""
    args = parse_args(argv)
    layout = validate_args(args, world)
    vocab = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, layout.tp)
    n = stage_parameters(MemorySetup.from_run(args, layout, vocab))
    return predict_step(args, layout, hw, vocab, n, distributed_optimizer=args.use_distributed_optimizer)


def calibrate(hw: Hardware, argv: list[str], measured_s: float, world: int = 2) -> Hardware:
    """``hw`` with the achieved fraction that makes the compute of ``argv``'s step equal its measured
    time minus its predicted communication: fraction = compute at 1 / (measured - communication)."""
    at_one = predict_run(argv, dataclasses.replace(hw, achieved_fraction=1.0), world)
    communication = at_one.step - at_one.compute
    if measured_s <= communication:
        raise ValueError(
            f"a step of {1000 * measured_s:.1f} ms leaves no time for compute after the predicted "
            f"{1000 * communication:.1f} ms of communication: calibrate on a layout that computes more"
        )
    return dataclasses.replace(hw, achieved_fraction=at_one.compute / (measured_s - communication))
