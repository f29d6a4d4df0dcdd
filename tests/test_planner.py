"""The planner: the layouts that fit, ranked by the step-time model; the others say what overflows."""

from __future__ import annotations

import dataclasses

import pytest

from distlab.gpt.arguments import parse_args
from distlab.gpt.layout import Layout
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
