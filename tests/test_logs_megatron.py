"""Megatron log parsing, on lines written by the engine's own formatters, and the exercise check."""

from __future__ import annotations

import pytest

from distlab.checks import ExerciseError
from distlab.gpt.memory.meters import format_memory
from distlab.gpt.training.log import iteration_line
from distlab.logs import megatron
from distlab.logs.exercise import check_layout_run
from distlab.logs.placement import placement_rows


def _iteration(it: int, total: int, ms: float, gbs: int = 8) -> str:
    return iteration_line(iteration=it, train_iters=total, consumed_samples=it * gbs, elapsed_ms=ms, lr=1e-3,
                          global_batch_size=gbs, loss=8.0 - it / 10, loss_scale=1.0, grad_norm=1.0, skipped=0,
                          nan=0, tokens_per_s=gbs * 64 / ms * 1000, tflops_per_device=0.002, mfu=None)  # fmt: skip


def _log(world: int, tp: int, pp: int, iters: int = 3, total: int = 3) -> str:
    mem = {"parameters": 4 * 1000, "gradients": 4000, "optimizer_state": 8000, "peak": 2**29, "peak_kind": "peak RSS",
           "num_parameters": 1000}  # fmt: skip
    dp = world // (tp * pp)
    lines = [megatron.banner_line(world, tp, pp), " > number of parameters on (tensor, pipeline) model parallel "
             "rank (0, 0): 185536"]  # fmt: skip
    for r in range(world):
        lines.append(format_memory(r, mem, f" tp {r % tp} pp {r // (tp * dp)} dp {(r // tp) % dp}"))
    lines += [_iteration(i, total, 100.0 + 10 * (i == 1)) for i in range(1, iters + 1)]
    return "\n".join(lines)


def test_banner_iterations_parameters_memory():
    text = _log(4, 2, 2)
    assert megatron.parse_banner(text) == megatron.Banner(4, 1, 2, 2)
    assert megatron.parse_banner(text).line() == (
        "using world size: 4, data-parallel-size: 1, tensor-model-parallel size: 2, pipeline-model-parallel size: 2"
    )
    its = megatron.iterations(text)
    assert [r["it"] for r in its] == [1, 2, 3] and [r["samples"] for r in its] == [8, 16, 24]
    assert its[0]["ms"] == 110.0 and its[2]["loss"] == pytest.approx(7.7)
    assert megatron.parameter_counts(text) == {(0, 0): 185536}
    mem = megatron.memory_rows(text)
    assert [(m["rank"], m["tp"], m["pp"], m["dp"]) for m in mem] == [
        (0, 0, 0, 0),
        (1, 1, 0, 0),
        (2, 0, 1, 0),
        (3, 1, 1, 0),
    ]
    assert mem[0]["values"] == 1000 and mem[0]["peak_mib"] == 512.0


def test_throughput_leaves_out_the_first_iteration_and_efficiency_is_per_device():
    one = megatron.throughput(_log(1, 1, 1))
    assert one["ms_per_iter"] == 100.0 and one["samples_per_s"] == 80.0
    rows = megatron.with_efficiency({"1": one, "4": {**one, "devices": 4, "samples_per_s": 160.0}})
    assert rows["1"]["efficiency"] == 1.0 and rows["4"]["efficiency"] == 0.5
    ref = megatron.reference_rows()
    assert ref["2 nodes x 2 GPUs"]["samples_per_s"] == pytest.approx(8000 / 537.3)
    assert ref["2 nodes x 2 GPUs"]["efficiency"] == pytest.approx((8 / 537.3 / 4) / (2 / 271.6))
    with pytest.raises(ValueError, match="no iteration lines"):
        megatron.throughput(megatron.banner_line(1))


def test_placement_from_hosts_and_memory_report():
    text = "0: node1\n1: node1\n2: node2\n3: node2\n" + _log(4, 2, 2)
    rows = placement_rows(text)
    assert [(r["rank"], r["host"], r["tp_group"], r["pp_group"], r["dp_group"]) for r in rows] == [
        (0, "node1", [0, 1], [0, 2], [0]),
        (1, "node1", [0, 1], [1, 3], [1]),
        (2, "node2", [2, 3], [0, 2], [2]),
        (3, "node2", [2, 3], [1, 3], [3]),
    ]


def test_exercise_check_passes_only_on_tp2_pp2_dp1_trained_to_the_end(capsys):
    assert check_layout_run(_log(4, 2, 2), world_size=4, tp=2, pp=2)
    assert check_layout_run(None, world_size=4, tp=2, pp=2) is False
    assert "[not yet]" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match="data-parallel-size: 2"):  # TP=2, PP=1: DP=2
        check_layout_run(_log(4, 2, 1), world_size=4, tp=2, pp=2)
    with pytest.raises(ExerciseError, match="False"):  # right layout, stopped after 2 of 3 iterations
        check_layout_run(_log(4, 2, 2, iters=2), world_size=4, tp=2, pp=2)
    with pytest.raises(ExerciseError, match="no 'using world size:' line"):
        check_layout_run("pretrain_gpt.py: error: --global-batch-size 3 ...", world_size=4, tp=2, pp=2)


def test_batch_line_and_a_job_of_several_runs():
    line = "> global batch size 16 = micro batch 1 x data-parallel 4 x accumulation steps 4"
    assert megatron.batch_arithmetic("x\n" + line) == {
        "global_batch": 16,
        "micro_batch": 1,
        "dp": 4,
        "accumulation": 4,
    }
    assert megatron.batch_arithmetic("no such line") == {}
    runs = megatron.split_runs("job 7 on node[1-2]\n" + _log(2, 1, 2) + "\n" + _log(4, 1, 4, iters=2))
    assert [megatron.parse_banner(r).pp for r in runs] == [2, 4]
    assert [len(megatron.iterations(r)) for r in runs] == [3, 2]


def test_scaling_plot_draws_ours_beside_the_reference():
    from distlab.logs.plots import plot_scaling

    ref = megatron.reference_rows()
    fig = plot_scaling(ref, ref, "ours", "reference")
    assert len(fig.axes) == 5  # three panels, two with a second axis for the reference
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["ours", "reference"]
    assert sorted(len(ax.patches) for ax in fig.axes) == [
        3,
        3,
        3,
        3,
        6,
    ]  # efficiency: both series on one axis
