"""All-reduces (and all-to-alls) counted per step in a real profiler trace (one gloo rank, two traced steps)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distlab.distributed import DistContext
from distlab.gpt.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from distlab.logs.trace import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    REDUCE_SCATTER,
    all_reduces_per_step,
    bytes_sent_per_rank,
    collective_bytes_per_step,
    collectives_per_step,
    load_trace,
    memory_per_step,
    ops_per_step,
)
from tests.conftest import run_gloo


def _traced_steps(ctx: DistContext, out: str) -> None:
    """Three profiled steps of 5 all-reduces and 1 all-to-all each; the last two are traced into ``out``."""
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(out, "rank0"),
    )  # fmt: skip
    with prof:
        for _ in range(3):
            for _ in range(4):  # 4 per step of shape (2, 8, 16): the block's f and g
                dist.all_reduce(torch.ones(2, 8, 16))
            dist.all_reduce(torch.ones(()))  # 1 per step: a scalar
            dist.all_to_all_single(torch.empty(3, 16), torch.ones(3, 16))  # 1 per step: expert dispatch
            prof.step()


def test_counts_all_reduces_by_shape_per_traced_step(tmp_path):
    run_gloo(_traced_steps, 1, str(tmp_path))
    rows = all_reduces_per_step(load_trace(tmp_path))
    assert rows == [
        {"shape": (2, 8, 16), "numel": 256, "per_step": 4.0},
        {"shape": (), "numel": 1, "per_step": 1.0},
    ]
    assert ops_per_step(load_trace(tmp_path), ALLTOALL) == [{"shape": (3, 16), "numel": 48, "per_step": 1.0}]


def test_no_trace_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="--profile-execution True"):
        load_trace(tmp_path)


def _sequence_parallel_steps(ctx: DistContext, out: str) -> None:
    """A sequence-parallel column -> row pair (b 2, T 8 split over 2 ranks, H 16), forward and
    backward, three profiled steps; rank 0's last two are traced into ``out``."""
    torch.manual_seed(0)
    col = ColumnParallelLinear(16, 32, group=dist.group.WORLD, sequence_parallel=True)
    row = RowParallelLinear(32, 16, group=dist.group.WORLD, sequence_parallel=True)
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(out, f"rank{ctx.rank}"),
    )  # fmt: skip
    with prof:
        for _ in range(3):
            x = torch.randn(2, 4, 16, requires_grad=True)  # (b, T/p, H): this rank's shard
            row(col(x)).sum().backward()
            prof.step()


def test_counts_sequence_parallel_gathers_and_scatters(tmp_path):
    run_gloo(_sequence_parallel_steps, 2, str(tmp_path))
    trace = load_trace(tmp_path / next(p.name for p in tmp_path.glob("rank0*")))
    shard = {"shape": (2, 4, 16), "numel": 128}
    # forward: g gathers before the column GEMM, g-bar reduce-scatters after the row GEMM;
    # backward: g-bar's all-gather, the column GEMM's re-gather for dW and its dX reduce-scatter
    assert ops_per_step(trace, ALLGATHER) == [shard | {"per_step": 3.0}]
    assert ops_per_step(trace, REDUCE_SCATTER) == [shard | {"per_step": 2.0}]
    assert all_reduces_per_step(trace) == []
    assert collectives_per_step(trace) == {("all_gather", "c10d"): 3.0, ("reduce_scatter", "c10d"): 2.0}
    # one all-reduce of the (b, T, H) sum = one reduce-scatter + one all-gather of its shards
    full = bytes_sent_per_rank(ALLREDUCE, 2 * 8 * 16, 2)
    assert full == bytes_sent_per_rank(ALLGATHER, 128, 2) + bytes_sent_per_rank(REDUCE_SCATTER, 128, 2)


def _fsdp_like_steps(ctx: DistContext, out: str) -> None:
    """Three profiled steps (the last two traced, with memory): a bf16 all-gather of 2 x 64 values
    and an fp32 reduce-scatter of 64; a forward that keeps h (65,536 fp32 values) for backward,
    and a backward that allocates w's gradient (65,536 more, freed at the step's end)."""
    w = torch.ones(65536, requires_grad=True)
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, profile_memory=True,
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(out, "rank0"),
    )  # fmt: skip
    with prof:
        for _ in range(3):
            dist.all_gather_into_tensor(
                torch.empty(64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
            )
            dist.all_gather_into_tensor(
                torch.empty(64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
            )
            dist.reduce_scatter_tensor(torch.empty(64), torch.ones(64))
            h = w * 2  # (65536,) kept: the step's activation
            (h * h).sum().backward()
            w.grad = None
            del h
            prof.step()


def test_collective_bytes_and_memory_per_step(tmp_path):
    run_gloo(_fsdp_like_steps, 1, str(tmp_path))
    trace = load_trace(tmp_path)
    assert collective_bytes_per_step(trace) == {("all_gather", "c10::BFloat16"): 2 * 64 * 2,
                                                ("reduce_scatter", "float"): 64 * 4}  # fmt: skip
    rows = memory_per_step(trace)
    assert [r["step"] for r in rows] == ["ProfilerStep#1", "ProfilerStep#2"]
    for r in rows:  # h (and the scalar loss) at backward's start; then h * h's gradients and w's
        assert r["backward"] == pytest.approx(4 * 65536, abs=1024), r
        assert r["peak"] >= r["backward"] + 4 * 65536, r


def test_memory_per_step_needs_memory_events(tmp_path):
    run_gloo(_traced_steps, 1, str(tmp_path))
    with pytest.raises(ValueError, match="profile_memory=True"):
        memory_per_step(load_trace(tmp_path))
