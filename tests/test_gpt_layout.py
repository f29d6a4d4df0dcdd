"""The run's one layout: Megatron's rank order, the batch arithmetic (ramps included), and
messages that name every value."""

from __future__ import annotations

import pytest

from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.layout import Layout, parse_step_schedule, rampup_schedule
from distlab.gpt.model_layout import ModelShape, check_model_layout

pytestmark = pytest.mark.engine_fast


def test_megatron_rank_order_world_8() -> None:
    layout = Layout(8, tp=2, pp=2)
    assert layout.dp == 2
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # adjacent: one node each
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for r in range(8):
        assert layout.rank_of(*layout.coords(r)) == r
    assert [layout.coord(5, d) for d in ("tp", "dp", "pp")] == [1, 0, 1]
    # Every rank is in exactly one group of each kind.
    for dim in ("tp", "dp", "pp"):
        assert sorted(r for g in layout.groups(dim) for r in g) == list(range(8))


def test_course_layout_tp2_pp2_on_2_nodes_x_2() -> None:
    layout = Layout(4, tp=2, pp=2)
    assert layout.dp == 1
    assert layout.groups("tp") == [[0, 1], [2, 3]]  # node1 holds stage 0, node2 stage 1
    assert layout.groups("pp") == [[0, 2], [1, 3]]  # p2p crosses the nodes


def test_world_size_message_names_every_value() -> None:
    with pytest.raises(
        ValueError,
        match=r"world size 6 is not divisible by tensor-model-parallel size 2 x "
        r"context-parallel size 1 x pipeline-model-parallel size 2 = 4",
    ):
        Layout(6, tp=2, pp=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        Layout(4, tp=0, pp=1)


def test_model_and_batch_messages_name_every_value() -> None:
    layout = Layout(4, tp=2, pp=2)
    with pytest.raises(ValueError) as err:
        check_model_layout(ModelShape(num_layers=3, hidden_size=34, num_attention_heads=3), layout)
    msg = str(err.value)
    for part in (
        "--num-attention-heads 3",
        "--hidden-size 34",
        "--num-layers 3",
        "--tensor-model-parallel-size 2",
        "--pipeline-model-parallel-size 2",
    ):
        assert part in msg
    check_model_layout(ModelShape(num_layers=4, hidden_size=32, num_attention_heads=4), layout)  # fine
    assert Layout(4, tp=1, pp=2, micro_batch_size=2, global_batch_size=8).num_micro_batches == 2
    assert Layout(4, pp=2, micro_batch_size=2).global_batch_size == 4  # default: micro x dp
    with pytest.raises(
        ValueError,
        match=r"--global-batch-size 6 is not divisible by --micro-batch-size 4 x "
        r"data-parallel size 2 = 8",
    ):
        Layout(4, tp=1, pp=2, micro_batch_size=4, global_batch_size=6)


def test_rampup_grows_as_megatron_documents() -> None:
    # Megatron's example: 16 -> 1024 by 8 over 300000 samples: 126 intervals of ~2380 samples.
    steps = rampup_schedule(16, 8, 300000, 1024)
    assert len(steps) == 127 and steps[0] == (0, 16) and steps[-1] == (300000, 1024)
    assert steps[1] == (2381, 24)  # ceil(300000 / 126)
    layout = Layout(2, micro_batch_size=4, global_batch_size=1024, batch_schedule=steps)
    assert [layout.global_batch_at(c) for c in (0, 2380, 2381, 299999, 300000, 10**9)] == [
        16,
        16,
        24,
        1016,
        1024,
        1024,
    ]
    assert layout.micro_batches_at(2381) == 3 and layout.num_micro_batches == 128
    with pytest.raises(
        ValueError, match=r"minus the start 16 = 1008 must be >= 0 and a multiple of the increment 10"
    ):
        rampup_schedule(16, 10, 300000, 1024)


def test_every_size_of_a_ramp_obeys_the_data_parallel_rule() -> None:
    steps = rampup_schedule(4, 2, 60, 8)  # 4, 6, 8: 6 is not a multiple of micro 2 x dp 2
    with pytest.raises(ValueError) as err:
        Layout(2, micro_batch_size=2, global_batch_size=8, batch_schedule=steps)
    msg = str(err.value)
    assert "global batch sizes [6]" in msg and "--micro-batch-size 2 x data-parallel size 2 = 4" in msg


def test_step_schedule_reads_tokens_as_megatron() -> None:
    steps = parse_step_schedule("0:16 2.4B:320 12B:1536", seq_length=2048)
    assert steps == ((0, 16), (1171875, 320), (5859375, 1536))
    for bad in ("0:16 oops", "5K:16", "0:16 1K:32"):
        with pytest.raises(ValueError, match="--step-batch-size-schedule"):
            parse_step_schedule(bad, 2048)


ARGS = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --train-iters 4 --lr 1e-3"


def test_validate_args_returns_the_one_layout() -> None:
    args = parse_args(f"{ARGS} --global-batch-size 16 --rampup-batch-size 4 4 64".split())
    with pytest.raises(ValueError, match="--data-path is required"):  # the files come last
        validate_args(args, 2)
    layout = Layout(2, micro_batch_size=2, global_batch_size=16, batch_schedule=rampup_schedule(4, 4, 64, 16))
    from distlab.gpt.arguments import build_layout

    assert build_layout(args, 2) == layout
    with pytest.raises(ValueError, match="--rampup-batch-size needs --global-batch-size"):
        build_layout(parse_args(f"{ARGS} --rampup-batch-size 4 4 64".split()), 2)
    both = parse_args(f"{ARGS} --global-batch-size 8 --step-batch-size-schedule 0:4,64:16".split())
    with pytest.raises(ValueError, match="--global-batch-size 8 differs from the last batch 16"):
        build_layout(both, 2)
