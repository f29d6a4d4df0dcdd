"""The planner: the layouts that fit, ranked by the step-time model; the others say what overflows."""

from __future__ import annotations

import dataclasses

import pytest

from distlab.gpt.arguments import parse_args
from distlab.gpt.layout import Layout
from distlab.gpt.planning import budget
from distlab.gpt.planning.dry_run import GiB
from distlab.gpt.planning.hardware import load
from distlab.gpt.planning.planner import candidate_layouts, evaluate, plan, report

pytestmark = pytest.mark.engine_fast

GPT_13B = (
    "--num-layers 40 --hidden-size 5120 --num-attention-heads 40 --seq-length 2048 --micro-batch-size 1 "
    "--global-batch-size 256 --vocab-size 50257 --lr 1e-4 --bf16 --overlap-grad-reduce"
).split()


def test_the_fitting_layouts_come_first_fastest_first_and_the_best_five_say_why() -> None:
    args, hw = parse_args(GPT_13B), load("h100_sxm_node")
    found = plan(args, 64, hw)
    fit = [c for c in found if c.fits]
    assert fit and len(fit) < len(found)  # some layouts of a 13B model do not fit in 80 GiB
    steps = [c.prediction.step for c in fit]
    assert steps == sorted(steps)
    assert all(c.peak <= hw.memory_bytes for c in fit)
    lines = report(found)
    assert lines[0].startswith(f"> {len(fit)} of {len(found)} runnable layouts fit; the best 5:")
    assert all("bubble" in line and "memory headroom" in line for line in lines[1:6])
    assert all(lay.world_size == 64 and 256 % (lay.micro_batch_size * lay.dp) == 0
               for lay in candidate_layouts(args, 64, hw))  # fmt: skip


def test_a_layout_that_cannot_fit_names_the_state_that_overflows_and_by_how_much() -> None:
    args, hw = parse_args(GPT_13B), load("h100_sxm_node")
    small = dataclasses.replace(hw, memory_bytes=16 * GiB)
    c = evaluate(args, Layout(64, global_batch_size=256), small, distributed_optimizer=False)
    assert not c.fits
    assert c.states["optimizer state"] > c.states["parameters"]  # 12 of Megatron's 18 bytes per parameter
    over = (c.peak - small.memory_bytes) / GiB
    assert f"exceeds 16 GiB by {over:.1f} GiB; largest state: optimizer state" in c.why()


def test_the_command_line_prints_the_best_five(capsys) -> None:
    from distlab.gpt.planning.planner import main

    assert main(["--world-size", "64", "--", *GPT_13B]) == 0
    out = capsys.readouterr().out
    assert "64 devices; global batch 256 x 2048 tokens" in out and "layouts fit; the best 5:" in out


def test_only_layouts_the_engine_accepts_are_ranked_and_a_refused_one_keeps_its_message() -> None:
    from distlab.gpt.arguments.validation import engine_layout
    from distlab.gpt.planning.planner import sized

    args, hw = parse_args(GPT_13B), load("h100_sxm_node")
    refused = []
    found = plan(args, 64, hw, refused=refused)
    for c in found:  # the engine builds this very layout from the candidate's command line
        lay = c.layout
        run = sized(args, tp=lay.tp, pp=lay.pp, cp=lay.cp, micro_batch_size=lay.micro_batch_size, vp=lay.vp)
        assert engine_layout(run, 64) == lay
    assert refused and all(r.why.startswith("invalid arguments: ") for r in refused)
    pp16 = next(r for r in refused if r.name == "tp 1 pp 16 cp 1 b 1")  # 40 layers over 16 stages
    assert pp16.why == engine_layout(sized(args, tp=1, pp=16, micro_batch_size=1), 64)
    assert "--num-layers 40 is not divisible by --pipeline-model-parallel-size 16" in pp16.why
    lines = report(found, refused=refused)
    assert f"> {len(refused)} layouts of the search are refused by the engine's validate_args:" in lines


def test_the_report_prints_mfu_and_hfu_each_with_its_convention() -> None:
    args, hw = parse_args(GPT_13B), load("h100_sxm_node")
    lines = report(plan(args, 64, hw), top=2)
    assert all(" MFU " in line and " HFU " in line for line in lines[1:3])
    assert "MFU: model FLOPs, no recomputation, causal attention at half" in lines[3]
    assert "HFU: MFU's FLOPs + the recomputed forward" in lines[3]


def test_narayanan_et_al_s_end_to_end_time_for_gpt3_by_hand() -> None:
    """8 T P / (n X): 175e9 parameters, 300e9 tokens, 1,024 GPUs at 140 TFLOP/s = 2.93e6 s, 33.9
    days (the paper, section 5.1: "about 34 days")."""
    seconds = budget.narayanan_seconds(300e9, 175e9, 1024, 140e12)
    assert seconds == pytest.approx(8 * 300e9 * 175e9 / (1024 * 140e12))
    assert seconds / 86400 == pytest.approx(33.91, abs=0.01)


def test_the_failure_side_by_hand() -> None:
    """Llama 3: 419 interruptions / (54 days x 24 h x 16,384 GPUs) = 1.973e-5 per GPU-hour, one
    every 3.09 hours on 16,384 GPUs; a checkpoint of 70e9 parameters in bf16 holds 14 bytes each;
    C 100 s, M 20,000 s: tau = sqrt(2 x 100 x 20,000) = 2,000 s, lost 100/2,000 + 1,000/20,000 = 0.1."""
    assert budget.LLAMA3_FAILURES_PER_GPU_HOUR == pytest.approx(1.9733e-5, rel=1e-4)
    assert 1 / (budget.LLAMA3_FAILURES_PER_GPU_HOUR * 16384) == pytest.approx(3.093, abs=1e-3)
    assert budget.checkpoint_bytes(70e9) == 980e9
    assert budget.checkpoint_bytes(1e9, "fp32") == 12e9  # 4 + 8: no separate master copy
    assert budget.goodput(100, 20_000, 0) == pytest.approx((2000, 0.9))
    assert budget.goodput(100, 20_000, 200)[1] == pytest.approx(0.89)  # a restart of 200 s: + 1%


def test_a_plan_s_time_cost_and_goodput_by_hand() -> None:
    """The 13B (12,853,626,880 parameters: 40 (12 h^2 + 13 h) + (50,304 + 2,048) h + 2 h) on 64
    GPUs, 1e12 tokens at $2 a GPU-hour, 10 GB/s to storage, 1e-4 failures per GPU-hour, no restart."""
    args, hw = parse_args(GPT_13B), load("h100_sxm_node")
    best = plan(args, 64, hw)[0]
    inputs = budget.Inputs(tokens=1e12, usd_per_gpu_hour=2.0, storage_bytes_per_s=10e9,
                           failures_per_gpu_hour=1e-4, restart_s=0.0)  # fmt: skip
    b = budget.budget(args, best, hw.peak_flops, inputs)
    P = 40 * (12 * 5120**2 + 13 * 5120) + (50304 + 2048) * 5120 + 2 * 5120
    assert budget.model_parameters(args) == P == 12_853_626_880
    seconds = 1e12 / (best.prediction.tokens_per_s_per_device * 64)
    assert b.days == pytest.approx(seconds / 86400) and b.usd == pytest.approx(2 * 64 * seconds / 3600)
    assert b.check_days == pytest.approx(6 * 1e12 * P / (64 * best.prediction.mfu * hw.peak_flops) / 86400)
    assert abs(b.check_days / b.days - 1) < 0.1  # 6 T P / (n X) leaves out attention and the output layer
    C, M = 14 * P / 10e9, 3600 / (1e-4 * 64)
    assert (b.save_s, b.mtbf_h * 3600) == pytest.approx((C, M))
    tau = (2 * C * M) ** 0.5
    assert b.interval_h * 3600 == pytest.approx(tau)
    assert b.goodput == pytest.approx(1 - C / tau - tau / 2 / M)
    assert b.days_with_failures == pytest.approx(b.days / b.goodput)
    assert b.interruptions == pytest.approx(b.days_with_failures * 86400 / M)
    lines = budget.table(args, plan(args, 64, hw), hw.peak_flops, inputs, top=2)
    assert len(lines) == 4 and "goodput" in lines[0] and "6TP/(nX)" in lines[0]


def test_the_search_plot_draws_the_fitting_the_overflowing_and_names_the_refused() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from distlab.gpt.planning.search_plot import plot_search

    args, hw = parse_args(GPT_13B), load("h100_sxm_node")
    refused = []
    found = plan(args, 64, hw, refused=refused)
    ax = plot_search(found, refused)
    fit, over = ax.collections[0], ax.collections[1]
    assert len(fit.get_offsets()) == sum(c.fits for c in found)
    assert len(over.get_offsets()) == sum(not c.fits for c in found)
    counts = [int(line.split()[0]) for line in ax.get_title(loc="left").splitlines()]
    assert sum(counts) == len(refused) and counts == sorted(counts, reverse=True)  # one line per reason
