"""Megatron log-line format, learning-rate schedule and FLOPs arithmetic."""

from __future__ import annotations

import json
import math

import pytest
import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.from_args import model_flops_per_iteration
from distlab.gpt.arguments.to_configs import flops_config, lr_schedule
from distlab.gpt.training.flops import counted_flops, flops_line, measure_gemm_tflops, mfu
from distlab.gpt.training.log import (
    ITERATION_RE,
    ProfilerConfig,
    StepProfiler,
    iteration_line,
    validation_lines,
)

pytestmark = pytest.mark.engine_fast

# The line of the issue, which the notebooks grep (Megatron-LM's training_log).
MEGATRON = (" iteration      100/     100 | consumed samples:          800 | elapsed time per iteration (ms): 537.3 |"
            " learning rate: 5.822E-05 | global batch size:     8 | lm loss: 7.448950E+00 | loss scale: 1.0 |"
            " grad norm: 1.303 | number of skipped iterations:   0 | number of nan iterations:   0 |")  # fmt: skip


def test_iteration_line_is_megatrons_then_throughput():
    line = iteration_line(iteration=100, train_iters=100, consumed_samples=800, elapsed_ms=537.31, lr=5.8219e-05,
                          global_batch_size=8, loss=7.44895, loss_scale=1.0, grad_norm=1.3034, skipped=0, nan=0,
                          tokens_per_s=15234.56, tflops_per_device=0.1234, mfu=0.0456)  # fmt: skip
    assert line.startswith(MEGATRON)
    assert line[len(MEGATRON) :] == " tokens per second: 15234.6 | TFLOP/s per device: 0.123 | MFU: 4.6% |"
    m = ITERATION_RE.match(line)
    assert (m["it"], m["samples"], m["lr"], m["loss"], m["gnorm"]) == (
        "100",
        "800",
        "5.822E-05",
        "7.448950E+00",
        "1.303",
    )
    assert ITERATION_RE.match(MEGATRON)


def test_skipped_iteration_has_no_grad_norm_and_still_matches():
    line = iteration_line(iteration=3, train_iters=10, consumed_samples=6, elapsed_ms=1.0, lr=0.0,
                          global_batch_size=2, loss=float("nan"), loss_scale=65536.0, grad_norm=None, skipped=1,
                          nan=1, tokens_per_s=1.0, tflops_per_device=0.0, mfu=None)  # fmt: skip
    assert "grad norm" not in line and "MFU" not in line
    m = ITERATION_RE.match(line)
    assert m["loss"] == "NAN" and m["skipped"] == "1" and m["scale"] == "65536.0"


def test_validation_box():
    bar, body, bar2 = validation_lines("iteration 10", math.log(100.0))
    assert (
        body
        == " validation loss at iteration 10 | lm loss value: 4.605170E+00 | lm loss PPL: 1.000000E+02 | "
    )
    assert bar == bar2 == "-" * (len(body) + 1)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_lr_schedule_warmup_decay_floor(style):
    args = PretrainArgs(lr=1.0, min_lr=0.1, lr_decay_style=style, lr_decay_iters=100, lr_warmup_fraction=0.1,
                        train_iters=120)  # fmt: skip
    lr = lr_schedule(args)
    assert [lr(i) for i in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])  # linear warm-up over 10
    mid = 0.1 + 0.9 * (0.5 if style == "linear" else 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert lr(55) == pytest.approx(mid)
    assert lr(100) == pytest.approx(0.1) and lr(120) == 0.1
    assert all(lr(i) >= lr(i + 1) for i in range(10, 119))


def test_model_flops_formula():
    # GPT-2 small, 1 sample of 1024 tokens: 72 s l h^2 (1 + s/(6h) + V/(12 l h)) ~ 0.88 TFLOP (6 N s + attention)
    args = PretrainArgs(
        num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, global_batch_size=1
    )
    f = model_flops_per_iteration(args, 50304)
    assert f == pytest.approx(72 * 1024 * 12 * 768**2 * (1 + 1024 / (6 * 768) + 50304 / (12 * 12 * 768)))
    assert 0.8e12 < f < 1.0e12
    args.recompute_activations = True  # selective: the scores again, not counted (Megatron's model FLOPs)
    assert model_flops_per_iteration(args, 50304) == pytest.approx(f)
    args.recompute_activations, args.recompute_granularity = False, "full"  # every block twice forward,
    args.recompute_method, args.recompute_num_layers = "uniform", 1  # the logit layer once (Narayanan 2021)
    assert model_flops_per_iteration(args, 50304) == pytest.approx(
        96 * 1024 * 12 * 768**2 * (1 + 1024 / (6 * 768) + 50304 / (16 * 12 * 768))
    )
    args.recompute_method, args.recompute_num_layers, args.pipeline_model_parallel_size = "block", 2, 2
    r = 2 * 2  # the first 2 blocks of each of the 2 stages run twice
    assert model_flops_per_iteration(args, 50304) == pytest.approx(
        f + r * 24 * 1024 * 768**2 * (1 + 1024 / (6 * 768))
    )
    assert "s/(6h)" in flops_line(flops_config(args, 50304))


SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=4096, seq_length=64, batch=2)


def _args(granularity=None):
    full = granularity == "full"
    return PretrainArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, global_batch_size=2,
                        recompute_granularity=granularity, recompute_method="uniform" if full else None,
                        recompute_num_layers=1 if full else None)  # fmt: skip


def test_model_flops_equal_pytorchs_flop_counter_on_the_engines_model():
    """The formula against an independent count: torch.utils.flop_counter over a forward + backward
    of the engine's GPT (notebook 04's shape). The old V/(16 l h) term (the full-recomputation
    form's) and Megatron-LM's causal half s/(12h) both miss it."""
    counted = counted_flops(**SHAPE)
    assert model_flops_per_iteration(_args(), 4096) == counted
    B, s, L, h, V = 2, 64, 2, 64, 4096
    for wrong in (1 + s / (6 * h) + V / (16 * L * h), 1 + s / (12 * h) + V / (12 * L * h)):
        assert abs(72 * B * s * L * h**2 * wrong - counted) > 0.01 * counted
    # full recomputation: every block's forward twice, the logit layer once, as the formula counts
    # with PyTorch's early stop off; with it (the default) the last GEMM of each group, fc2, is not rerun
    full = counted_flops(**SHAPE, recompute_granularity="full", checkpoint_early_stop=False)
    assert full == model_flops_per_iteration(_args("full"), 4096)
    assert counted_flops(**SHAPE, recompute_granularity="full") == full - L * 2 * B * s * h * 4 * h
    # selective: the scores again, counted by PyTorch but not by the model FLOPs (no more than Q K^T and
    # the scores times V, once per layer)
    selective = counted_flops(**SHAPE, recompute_granularity="selective")
    assert (
        model_flops_per_iteration(_args("selective"), 4096)
        == counted
        < selective
        <= counted + L * 4 * B * s * s * h
    )


def test_mfu_per_device_or_over_the_shared_machine():
    assert mfu(300.0, 8, 989.0, shared_machine=False) == pytest.approx(300 / 989)  # each GPU its own peak
    assert mfu(0.002, 4, 0.05, shared_machine=True) == pytest.approx(0.008 / 0.05)  # 4 ranks on one CPU


def test_measured_gemm_rate_counts_two_n_cubed_per_product(monkeypatch):
    """With a clock that advances 1 s per reading, one round of one product (after the start reading)
    takes 1 s: the rate is exactly 2 n^3 FLOP/s."""
    clock = iter(range(100))
    monkeypatch.setattr("distlab.gpt.training.flops.time.perf_counter", lambda: float(next(clock)))
    assert measure_gemm_tflops(torch.device("cpu"), size=8, rounds=1, min_time_s=0.5) == pytest.approx(
        2 * 8**3 / 1e12
    )
    assert measure_gemm_tflops(torch.device("cpu"), size=64, min_time_s=0.01) > 0


def test_measured_gemm_rate_with_the_jobs_threads_restores_torchs_count(monkeypatch):
    """A 1-thread job's peak is measured on 1 thread; the notebook's own thread count comes back."""
    seen, before = [], torch.get_num_threads()
    torch.set_num_threads(2)
    clock = lambda: seen.append(torch.get_num_threads()) or float(len(seen))  # noqa: E731
    monkeypatch.setattr("distlab.gpt.training.flops.time.perf_counter", clock)
    try:
        measure_gemm_tflops(torch.device("cpu"), size=8, rounds=1, min_time_s=0.5, threads=1)
        assert set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _profiled_iterations(tmp_path, capsys, first_iteration, last_iteration, start=3, end=5):
    """A tiny model's iterations ``first_iteration..last_iteration`` under StepProfiler, as the
    training loop drives it; returns the trace's events (None without a trace) and the printed log."""
    config = ProfilerConfig(profile_execution=True, profile_name="tiny", tensorboard_dir=str(tmp_path),
                            profile_step_start=start, profile_step_end=end)  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    profiler = StepProfiler(config, rank=0, first_iteration=first_iteration)
    for _ in range(first_iteration, last_iteration + 1):
        model(torch.randn(8, 16)).square().mean().backward()  # (b, 16)
        profiler.step()
    profiler.stop()
    traces = sorted((tmp_path / "tiny").glob("rank0.*.pt.trace.json"))
    events = json.loads(traces[0].read_text())["traceEvents"] if traces else None
    return events, capsys.readouterr().out


def test_profiler_traces_the_chosen_iterations_with_memory_and_stacks(tmp_path, capsys):
    events, out = _profiled_iterations(tmp_path, capsys, first_iteration=1, last_iteration=6)
    steps = {e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#4", "ProfilerStep#5"}  # warm-up on 3 (not written), traced 4 and 5
    assert "> profiling iterations 4-5 of rank 0 (warm-up: iteration 3)" in out
    assert f"> profiler trace of iterations 4-5 written under {tmp_path / 'tiny'}" in out
    assert any(e.get("name") == "[memory]" for e in events)  # profile_memory: allocations and frees
    assert any(e.get("cat") == "python_function" for e in events)  # with_stack: Python frames
    assert any(e.get("args", {}).get("Input Dims") for e in events)  # record_shapes


def test_profiler_after_load_keeps_iteration_numbers_and_refuses_a_missed_warm_up(tmp_path, capsys):
    events, _ = _profiled_iterations(tmp_path / "a", capsys, first_iteration=2, last_iteration=5)
    steps = {e["name"] for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#4", "ProfilerStep#5"}  # resumed at 2: the same iterations
    events, out = _profiled_iterations(tmp_path / "b", capsys, first_iteration=4, last_iteration=6)
    assert events is None
    assert "this run starts at iteration 4, after the warm-up iteration 3" in out
