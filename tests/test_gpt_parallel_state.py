"""Process groups as built from the layout on 4 ranks (the layout's arithmetic: test_gpt_layout.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distlab.distributed import DistContext
from distlab.gpt.layout import Layout
from distlab.gpt.parallel_state import ParallelState
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(120)


def _worker(ctx: DistContext) -> None:
    rank = ctx.rank
    state = ParallelState.build(Layout(4, tp=2, pp=2))
    ranks = dist.get_process_group_ranks
    assert ranks(state.tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    assert ranks(state.pp_group) == [rank % 2, rank % 2 + 2]
    assert ranks(state.dp_group) == [rank]
    assert ranks(state.embedding_group) == [rank % 2, rank % 2 + 2]
    assert (state.tp_rank, state.pp_rank, state.dp_rank) == (rank % 2, rank // 2, 0)
    assert state.is_first_stage == (rank < 2) and state.is_last_stage == (rank >= 2)
    assert state.stage_rank(1 - state.pp_rank) == (rank + 2) % 4
    assert state.banner() == (
        "using world size: 4, data-parallel-size: 1, "
        "tensor-model-parallel size: 2, pipeline-model-parallel size: 2"
    )
    # A tp all-reduce only mixes the two ranks of one stage.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=state.tp_group)
    assert t.item() == (0 + 1 if rank < 2 else 2 + 3)
    dist.barrier()


def test_groups_as_built_on_4_ranks() -> None:
    run_gloo(_worker, 4)


def test_pipeline_flags_are_checked_before_compute() -> None:
    from distlab.gpt.arguments import parse_args, validate_args

    argv = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
    argv += "--train-iters 1 --lr 1e-3 --pipeline-timeline runs/t.json"
    with pytest.raises(
        ValueError, match=r"--pipeline-timeline runs/t.json needs --pipeline-model-parallel-size > 1, got 1"
    ):
        validate_args(parse_args(argv.split()), 1)
    with pytest.raises(SystemExit):  # argparse names the choices
        parse_args((argv + " --pipeline-schedule zigzag").split())
