"""Notebook 13's readers and exercise check (``distlab.logs.planning``), and the local calibration.

A dry run's report, labelled by ``srun --label`` as the notebook's job prints it, must read back
to the DryRun's own numbers for each rank; the iteration times of a job of several runs come back
per run; the exercise's check says what to do while untouched, fails a layout that is not one, does
not fit, or is slower than the best by more than the tolerance, and passes the fastest; the
calibration makes the calibrating layout's prediction its measured time.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from distlab.checks import FIXME, ExerciseError
from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.planning import planner
from distlab.gpt.planning.dry_run import GiB, dry_run
from distlab.gpt.planning.hardware import Hardware, Link, load
from distlab.gpt.planning.local_cluster import calibrate, predict_run
from distlab.gpt.training.log import ITERATION
from distlab.logs import planning
from distlab.logs.megatron import banner_line
from tests.conftest import TINY_GPT_ARGV

ARGV = [
    *TINY_GPT_ARGV,
    *"--mock-data --tokenizer-type NullTokenizer --vocab-size 200".split(),
    *"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel".split(),
    "--use-distributed-optimizer",
]


def test_a_labelled_two_rank_dry_run_log_reads_back_each_ranks_report() -> None:
    args = parse_args(ARGV)
    layout = validate_args(args, 8)
    runs = {rank: dry_run(args, layout, rank) for rank in (0, 7)}
    log = "\n".join(f"{task}: {line}" for task, run in enumerate(runs.values()) for line in run.report())
    found = planning.dry_runs(log)
    assert sorted(found) == [0, 7]
    for rank, run in runs.items():
        got = found[rank]
        assert (got["world_size"], got["parameters"], got["precision"]) == (8, run.parameters, "fp32")
        assert got["micro_batches"] == run.num_micro_batches
        for how, distributed in (("without", False), ("with", True)):
            p, g, o = run.states(distributed)
            assert got["states"][how]["optim_gib"] == pytest.approx(o / GiB, abs=0.006)
            assert got["states"][how]["peak_gib"] == pytest.approx(run.peak(distributed) / GiB, abs=0.006)
        counts = Counter()
        for call in run.collectives:
            counts[(call.group, call.size, call.op)] += 1
        read = Counter()
        for c in got["collectives"]:
            read[(c["group"], c["size"], c["op"])] += c["count"]
        assert read == counts
    assert set(planning.gib_per_group(found[0])) == {"tp", "pp", "dp", "embedding"}  # tied embeddings


def _iteration(it: int, total: int, ms: float) -> str:
    fields = dict(it=it, total=total, samples=4 * it, ms=ms, lr=1e-4, gbs=4, loss=5.0, scale=1.0)
    return ITERATION.format(**fields, skipped=0, nan=0)


def test_step_seconds_are_per_run_without_the_first_iteration() -> None:
    runs = [(1, [900.0, 100.0, 120.0, 110.0]), (2, [800.0, 200.0, 260.0])]
    log = "\n".join(
        line
        for tp, ms in runs
        for line in [banner_line(2, tp=tp), *(_iteration(i + 1, len(ms), t) for i, t in enumerate(ms))]
    )
    assert planning.step_seconds(log) == [pytest.approx([0.1, 0.12, 0.11]), pytest.approx([0.2, 0.26])]
    median, q1, q3 = planning.median_and_spread([0.1, 0.12, 0.11, 0.3])
    assert median == pytest.approx(0.115) and q1 <= median <= q3


@pytest.fixture(scope="module")
def plan_70b():
    argv = (
        "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 "
        "--group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
        "--seq-length 8192 --vocab-size 128256 --bf16 --lr 1e-4 --micro-batch-size 1 "
        "--global-batch-size 512 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce"
    )
    args, hw = parse_args(argv.split()), load("h100_sxm_node")
    return args, hw, planner.plan(args, 256, hw)


def _check(answer, plan_70b) -> bool:  # the notebook's cell
    args, hw, candidates = plan_70b
    return planning.check_layout(answer, args, 256, hw, budget_gib=80, candidates=candidates)


def test_the_untouched_exercise_says_what_to_do_without_failing(plan_70b, capsys) -> None:
    assert _check(dict(tp=FIXME, pp=FIXME, micro_batch_size=FIXME), plan_70b) is False
    assert "[not yet]" in capsys.readouterr().out


@pytest.mark.parametrize(
    "answer,why",
    [
        (dict(tp=3, pp=4, micro_batch_size=1), "not divisible by"),
        (
            dict(tp=8, pp=32, micro_batch_size=1),
            "--num-layers 80 is not divisible by --pipeline-model-parallel-size 32",
        ),
        # the engine trains 8 query groups on tp 16 (each K/V head on two ranks), but tp crosses nodes
        (dict(tp=16, pp=2, micro_batch_size=1), r"tp 16 .* exposed communication tp \d+\.\d+ s"),
        (dict(tp=8, pp=1, micro_batch_size=1), "does not fit: peak 86.7 GiB exceeds 80 GiB"),
        # the smallest tp that fits: least tensor-parallel traffic, but 5 layers a stage and the output
        # layer (a 128,256-word vocabulary: about one layer's FLOPs) make the last stage 20% longer
        (
            dict(tp=4, pp=16, micro_batch_size=1),
            r"fits .*output layer .* 10% slower than the fastest layout that fits",
        ),
    ],
)
def test_a_wrong_layout_fails_saying_why(plan_70b, answer, why) -> None:
    with pytest.raises(ExerciseError, match=why):
        _check(answer, plan_70b)


def test_the_fastest_layout_that_fits_passes(plan_70b, capsys) -> None:
    args, hw, candidates = plan_70b
    best = planning.fastest(candidates, 80)
    lay = best.layout
    assert (lay.tp, lay.pp, lay.micro_batch_size) == (8, 2, 1)
    assert _check(dict(tp=8, pp=2, micro_batch_size=1), plan_70b) is True
    assert "[ok]" in capsys.readouterr().out


def test_calibration_makes_the_calibrating_layout_its_measured_time() -> None:
    link = Link(bandwidth=1e9, latency=1e-4)
    hw = Hardware("test", 2, 50e9, 1.0, 4 * GiB, link, link, flash_attention=False)
    argv = [*TINY_GPT_ARGV, *"--mock-data --tokenizer-type NullTokenizer --vocab-size 200".split()]
    argv += "--micro-batch-size 2 --global-batch-size 4".split()
    at_one = predict_run(argv, hw)
    measured = 3 * at_one.step
    calibrated = calibrate(hw, argv, measured)
    assert predict_run(argv, calibrated).step == pytest.approx(measured)
    assert calibrated.achieved_fraction < 1
    with pytest.raises(ValueError, match="leaves no time for compute"):
        calibrate(hw, argv, (at_one.step - at_one.compute) / 2)
    assert dataclasses.replace(calibrated, achieved_fraction=1.0) == hw
