"""Parallel layout: Megatron rank order, groups as built, and messages that name every value."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distlab.distributed import DistEnv, free_port, init_distributed, shutdown
from distlab.gpt.parallel_state import ParallelDims, ParallelState

pytestmark = pytest.mark.timeout(120)


def test_megatron_rank_order_world_8() -> None:
    dims = ParallelDims(8, tp=2, pp=2)
    assert dims.dp == 2
    assert dims.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]  # adjacent: one node each
    assert dims.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for r in range(8):
        assert dims.rank_of(*dims.coords(r)) == r
    # Every rank is in exactly one group of each kind.
    for groups in (dims.tp_groups(), dims.dp_groups(), dims.pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_course_layout_tp2_pp2_on_2_nodes_x_2() -> None:
    dims = ParallelDims(4, tp=2, pp=2)
    assert dims.dp == 1
    assert dims.tp_groups() == [[0, 1], [2, 3]]  # node1 holds stage 0, node2 stage 1
    assert dims.pp_groups() == [[0, 2], [1, 3]]  # p2p crosses the nodes


def test_world_size_message_names_every_value() -> None:
    with pytest.raises(
        ValueError,
        match=r"world size 6 is not divisible by tensor-model-parallel size 2 x "
        r"pipeline-model-parallel size 2 = 4",
    ):
        ParallelDims(6, tp=2, pp=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        ParallelDims(4, tp=0, pp=1)


def test_model_and_batch_messages_name_every_value() -> None:
    dims = ParallelDims(4, tp=2, pp=2)
    with pytest.raises(ValueError) as err:
        dims.validate_model(num_layers=3, num_attention_heads=3, hidden_size=33)
    msg = str(err.value)
    for part in (
        "--num-attention-heads 3",
        "--hidden-size 33",
        "--num-layers 3",
        "--tensor-model-parallel-size 2",
        "--pipeline-model-parallel-size 2",
    ):
        assert part in msg
    dims.validate_model(num_layers=4, num_attention_heads=4, hidden_size=32)  # fine
    assert ParallelDims(4, tp=1, pp=2).validate_batch(global_batch_size=8, micro_batch_size=2) == 2
    with pytest.raises(
        ValueError,
        match=r"--global-batch-size 6 is not divisible by --micro-batch-size 4 x "
        r"data-parallel size 2 = 8",
    ):
        ParallelDims(4, tp=1, pp=2).validate_batch(global_batch_size=6, micro_batch_size=4)


def _worker(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    init_distributed(
        "gloo", timeout_s=60, env=DistEnv(rank, world, rank, world, "127.0.0.1", port, "torchrun")
    )
    try:
        state = ParallelState.build(tp=2, pp=2)
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
    finally:
        shutdown()


def test_groups_as_built_on_4_ranks() -> None:
    mp.spawn(_worker, args=(4, free_port()), nprocs=4, join=True)


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
