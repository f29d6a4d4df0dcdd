"""The memory estimator against values computed by hand, and against the real model's count."""

from __future__ import annotations

import subprocess
import sys

import pytest

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import (
    MemorySetup,
    activation_bytes,
    block_bytes,
    estimate,
    korthikanti_layer_bytes,
    stage_layers_bytes,
    stage_parameters,
)
from distlab.gpt.memory.meters import cpu_peak_since, format_prediction, reset_cpu_peak
from distlab.gpt.memory.parameters import num_parameters
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel

pytestmark = pytest.mark.engine_fast

SBH = 128 * 4 * 64  # s=128, b=4, h=64: 32,768 values
FULL_1 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def tiny(**kw) -> MemorySetup:
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=4096)
    return MemorySetup(**{**base, "micro_batch_size": 4, **kw})


def test_gpt2_small_parameters() -> None:
    # SYLLABUS 04: 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = 124,438,272, plus the final LayerNorm 2h
    assert num_parameters(12, 768, 50257, 1024) == 124_438_272 + 2 * 768


def test_stage_parameters_match_the_model() -> None:
    c = tiny()
    model = GPTModel(GPTConfig(4, 64, 4, 4096, 128))
    assert (
        stage_parameters(c) == sum(p.numel() for p in model.parameters()) == num_parameters(4, 64, 4096, 128)
    )


def test_stage_parameters_with_tp_and_pp() -> None:
    # per layer (12 h^2 + 7h) / 2 + 6h = 24,800 + 384; two layers, E / 2, positions, no final LN
    assert stage_parameters(tiny(tp=2, pp=2)) == 2 * 25_184 + 4096 * 64 // 2 + 128 * 64 == 189_632


def test_korthikanti() -> None:
    # GPT-3 175B layer, s=2048, b=1, h=12288, a=96: s b h (34 + 5 * 96 * 2048 / 12288) = sbh * 114
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 114 == 2_868_903_936
    # t = 8: s b h (10 + 24/8 + 80/8) = sbh * 23
    assert korthikanti_layer_bytes(2048, 1, 12288, 96, tp=8) == 2048 * 12288 * 23


def test_layer_activations_by_precision_tp_recompute() -> None:
    assert block_bytes(tiny()) == 64 * SBH == 2_097_152  # 16 fp32 values per s b h
    assert block_bytes(tiny(precision="bf16")) == 32 * SBH  # 16 half: the residual stream too
    assert block_bytes(tiny(precision="bf16", fp32_residual_connection=True)) == 36 * SBH  # 2 fp32 + 14 half
    assert block_bytes(tiny(tp=2)) == (8 + 4 * 2 + 4 * 12 / 2) * SBH  # 12 of 16 split
    assert stage_layers_bytes(tiny(**FULL_1)) == 4 * 4 * SBH  # each block's input only
    assert stage_layers_bytes(tiny(precision="bf16", **FULL_1)) == 4 * 2 * SBH  # in the residual's bf16
    assert stage_layers_bytes(tiny(precision="fp16", fp32_residual_connection=True, **FULL_1)) == 4 * 4 * SBH
    # RMSNorm keeps an fp32 copy of its input and its fp32 normalised input, whatever the residual's dtype
    rms = [tiny(precision="bf16", normalization="RMSNorm", fp32_residual_connection=f) for f in (False, True)]
    assert block_bytes(rms[0]) == block_bytes(rms[1]) == (2 * 8 + 14 * 2) * SBH


def test_activations_head_recompute_and_pipeline() -> None:
    head = 4 * (2 * SBH + 3 * 4 * 128 * 4096)  # final LN in/out + three fp32 (b, s, V)
    assert activation_bytes(tiny()) == 4 * 64 * SBH + head
    # recompute: 4 inputs kept; the head's backward (bigger here) ends before a block is rebuilt
    assert activation_bytes(tiny(**FULL_1)) == 4 * 4 * SBH + head
    # 1F1B on the first of 2 stages: 2 layers x min(pp, M) = 2 micro-batches; GPipe keeps all 8;
    # no head there: the peak is the last block's MLP backward, with the residual's fp32 gradient
    # (4 sbh) and fc2's output and GeLU's gradients (fp32: 4 (1 + 4) sbh)
    assert activation_bytes(tiny(pp=2, num_micro_batches=8)) == 2 * 64 * SBH * 2 + 24 * SBH
    gpipe = tiny(pp=2, num_micro_batches=8, pipeline_schedule="gpipe")
    assert activation_bytes(gpipe) == 2 * 64 * SBH * 8 + 24 * SBH


@pytest.mark.parametrize("fp32_residual", [False, True], ids=["bf16 residual", "fp32 residual"])
def test_backward_of_a_rebuilt_block(fp32_residual: bool) -> None:
    """Selective recomputation rebuilds a block's scores and its attention backward holds
    12 b a s^2 bytes beside what the other blocks keep; full recomputation rebuilds a whole block
    next to the gradients made so far (module docstring of memory_estimate). Under bf16 the
    residual stream, its gradient and a checkpointed group's input take r = 2 bytes per value,
    4 with --fp32-residual-connection."""
    r = 4 if fp32_residual else 2
    bas2 = 4 * 4 * 128 * 128  # b a s^2
    bf16 = dict(precision="bf16", fp32_residual_connection=fp32_residual, vocab_size=256)
    c = tiny(**bf16, attention_backend="unfused", recompute_granularity="selective")
    kept = (2 * r + 14 * 2) * SBH  # per block: 2 residual + 14 half s b h values, no scores
    mlp_side = (r + 2 * (1 + 9)) * SBH  # LN2's input, its output and 9 half values, freed
    softmax = 4 * kept + r * SBH - mlp_side + 12 * bas2  # the last block's, at its softmax backward
    mlp = 4 * kept + r * SBH + 2 * (1 + 4) * SBH  # its MLP's backward: fc2's output and GeLU's gradients
    head = (r + 2) * SBH + 4 * 3 * 4 * 128 * 256  # the final LN's input and half output, 3 fp32 (b, s, V)
    assert activation_bytes(c) == max(softmax, mlp, 4 * kept + head) == softmax
    full = tiny(**bf16, **FULL_1)  # fused attention: no scores
    n, layer = stage_parameters(full), 12 * 64 * 64 + 13 * 64
    e = estimate(full)
    # a rebuilt block, the residual's gradient (r), its MLP's backward (2 (1 + 4)), in s b h
    rebuilt = kept + r * SBH + 10 * SBH
    first_group = 0 * r * SBH + rebuilt + 4 * n  # block 0 rebuilt, every gradient made
    last_group = 3 * r * SBH + rebuilt + 4 * (n - 3 * layer)  # blocks 0-2's not yet
    head_moment = 4 * r * SBH + head + 4 * (n - 4 * layer)
    assert e.activations_and_gradients == max(first_group, last_group, head_moment)
    copies = 2 * (n - 3 * layer)  # autocast's copies: of one rebuilt block, not of the other 3
    assert e.half_weight_copies == copies
    assert e.peak(first_iteration=True) == max(16 * n, 4 * n + copies + e.activations_and_gradients)


def test_model_states_per_zero_stage() -> None:
    n = stage_parameters(tiny())
    plain = estimate(tiny(dp=4))  # DDP: fp32 16 bytes per parameter, buckets double the gradients
    assert (plain.parameters, plain.gradients, plain.optimizer_state) == (4 * n, 8 * n, 8 * n)
    mixed = {z: estimate(tiny(dp=4, zero_stage=z, precision="bf16")) for z in (1, 2, 3)}
    assert (mixed[1].parameters, mixed[1].gradients, mixed[1].optimizer_state) == (2 * n, 2 * n, 3 * n)
    assert (mixed[2].parameters, mixed[2].gradients, mixed[2].optimizer_state) == (2 * n, n / 2, 3 * n)
    assert (mixed[3].parameters, mixed[3].gradients, mixed[3].optimizer_state) == (n / 2, n / 2, 3 * n)
    offload = estimate(tiny(dp=4, zero_stage=3, offload=True))
    assert (offload.parameters, offload.optimizer_state) == (0, 0)
    assert estimate(tiny(precision="fp16")).half_weight_copies == 2 * n  # autocast's copies


def test_peak_phases() -> None:
    e = estimate(tiny())
    n = stage_parameters(tiny())
    # the head's backward: its activations and the gradient of its parameters (the embedding)
    head_grads = 4 * (n - 4 * (12 * 64 * 64 + 13 * 64))
    assert e.activations_and_gradients == e.activations + head_grads
    assert e.peak() == 4 * n + 8 * n + e.activations_and_gradients  # steady state: Adam's state is there
    assert e.peak(first_iteration=True) == 4 * n + e.activations_and_gradients
    assert e.peak(accumulating=True) == 16 * n + e.activations  # every gradient is there already
    big_model = estimate(MemorySetup(2, 1024, 8, 8, 128, 1))  # tiny activations
    step = big_model.parameters + big_model.gradients + big_model.optimizer_state
    assert big_model.peak(first_iteration=True) == step  # no Adam state yet in backward: the step wins
    # later the end of backward holds every model state and block 0's activations
    assert (
        big_model.peak()
        == big_model.parameters + big_model.optimizer_state + big_model.activations_and_gradients
    )
    assert step < big_model.peak() < 1.01 * step


def test_bad_setups_fail_with_the_values() -> None:
    with pytest.raises(ValueError, match="fp8"):
        tiny(precision="fp8")
    with pytest.raises(ValueError, match="zero stage 4"):
        tiny(zero_stage=4)
    with pytest.raises(
        ValueError, match="fp32_residual_connection with precision 'fp32'.*give precision fp16"
    ):
        tiny(fp32_residual_connection=True)
    with pytest.raises(
        ValueError, match="--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"
    ):
        tiny(pp=3)


def test_prediction_line_and_cpu_peak() -> None:
    line = format_prediction(100 * 2**20, 110 * 2**20, "peak RSS above baseline")
    assert (
        line
        == "> memory: predicted peak 100.0 MiB | measured 110.0 MiB (peak RSS above baseline) | error +10.0%"
    )
    base = reset_cpu_peak()
    block = b"x" * (64 * 2**20)  # written: 64 MiB resident
    assert cpu_peak_since(base) >= 60 * 2**20
    del block


def test_from_run_reads_the_arguments_and_the_layout() -> None:
    args = PretrainArgs(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=128, bf16=True,
                        recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
                        attention_backend="unfused", pipeline_schedule="gpipe",
                        fp32_residual_connection=True)  # fmt: skip
    layout = Layout(8, tp=2, pp=2, micro_batch_size=4, global_batch_size=32)  # dp 2, m = 32 / (4 x 2) = 4
    zero = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert MemorySetup.from_run(args, layout, 4096, zero) == MemorySetup(
        4, 64, 4, 128, 4096, 4, precision="bf16", fp32_residual_connection=True,
        recompute_granularity="full", recompute_method="block",
        recompute_num_layers=1, attention_backend="unfused", num_micro_batches=4, tp=2, pp=2, dp=2,
        pipeline_schedule="gpipe", zero_stage=2, offload=True,
    )  # fmt: skip
    assert MemorySetup.from_run(PretrainArgs(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=128),
                                Layout(1, micro_batch_size=2), 4096).zero_stage == 0  # fmt: skip


def test_the_estimator_imports_without_torch() -> None:
    code = (
        "import sys, distlab.gpt.memory.memory_estimate; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
