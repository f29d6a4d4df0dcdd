"""All-reduces (and all-to-alls) counted per step in a real profiler trace (one gloo rank, two traced steps)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distlab.distributed import DistContext
from distlab.logs.trace import ALLTOALL, all_reduces_per_step, load_trace, ops_per_step
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
