"""The local cluster's hardware figures, measured here in a few seconds.

Notebook 04 measures the GEMM peak a job's ranks can reach (``training/flops.measure_gemm_tflops``:
large fp32 matrix products with the threads a rank computes with); notebook 02 times collectives
over gloo and reports nccl-tests' bus bandwidth (``distlab.comm.bench``). :func:`measure_local`
does both at a smaller scale: the GEMM rate of one rank's threads, and an all-reduce among
``ranks`` spawned gloo ranks at a small size (its time is the latency, alpha) and a large one
(bus bandwidth = 2 (n - 1) / n x bytes / (time - alpha)), and one memory-bound kernel the same way
(:func:`measure_elementwise`: an fp32 exp, softmax's kernel, on a few elements and on a block the
size of a ring-attention score block). Both nodes of the course's cluster are
this machine (loopback), so one link serves inside and between "nodes".

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

SMALL, LARGE = 1024, 8 * 2**20  # bytes of the all-reduces that give alpha and the bandwidth
TINY, BLOCK = 16, 2**16  # fp32 elements of the exps that give a kernel's latency and the bandwidth


def _time_all_reduce(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from distlab.local_ranks import torchrun_env

    os.environ.update(torchrun_env(rank, world, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        cpu = torch.device("cpu")
        times = [time_op(make_op("all_reduce", n // 4, cpu), cpu, 2, 20, 1.0)[0] for n in (SMALL, LARGE)]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def measure_link(ranks: int = 2) -> Link:
    """alpha and bus bandwidth of a gloo all-reduce among ``ranks`` local processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "times.json"))
        spawn_ranks(_time_all_reduce, (ranks, free_port(), out), ranks)
        small, large = json.loads(Path(out).read_text())
    factor = BUS_FACTOR["all_reduce"](ranks)
    return Link(bandwidth=factor * LARGE / max(large - small, 1e-9), latency=small)


def measure_elementwise(threads: int = 1, repeats: int = 200) -> Link:
    """Latency and bandwidth (bytes read + written per second) of an out-of-place fp32 exp with
    ``threads`` threads: the median time on TINY elements is the latency, on BLOCK elements (a
    (2, 8, 64, 64) score block, 256 KiB) latency + 8 BLOCK / bandwidth."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = []
        for n in (TINY, BLOCK):
            x = torch.randn(n)
            torch.exp(x)  # warm-up
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                torch.exp(x)
                runs.append(time.perf_counter() - start)
            times.append(statistics.median(runs))
    finally:
        torch.set_num_threads(previous)
    small, block = times
    return Link(bandwidth=8 * BLOCK / max(block - small, 1e-9), latency=small)


def measure_local(ranks_per_node: int = 2, threads_per_rank: int = 1, memory_gib: float = 4.0) -> Hardware:
    """The local cluster as :class:`Hardware`: one rank's GEMM rate (fp32, ``threads_per_rank``
    threads; achieved fraction 1 of it), the all-reduce link of ``ranks_per_node`` ranks for both
    links, no flash attention (the engine's CPU attention computes the whole s x s products)."""
    tflops = measure_gemm_tflops(torch.device("cpu"), size=512, min_time_s=0.1, threads=threads_per_rank)
    link = measure_link(ranks_per_node)
    elementwise = measure_elementwise(threads_per_rank)
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
        elementwise=elementwise,
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
