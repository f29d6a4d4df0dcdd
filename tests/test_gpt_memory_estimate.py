"""The memory estimator against values computed by hand, and against the real model's count."""

from __future__ import annotations

import pytest

from distlab.gpt.memory_estimate import (
    MemorySetup,
    activation_bytes,
    cpu_peak_since,
    estimate,
    format_prediction,
    korthikanti_layer_bytes,
    layer_activation_bytes,
    num_parameters,
    reset_cpu_peak,
    stage_parameters,
)
from distlab.gpt.model import GPTConfig, GPTModel

SBH = 128 * 4 * 64  # s=128, b=4, h=64: 32,768 values


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
    assert layer_activation_bytes(tiny()) == 68 * SBH == 2_228_224  # 17 fp32 values per s b h
    assert layer_activation_bytes(tiny(precision="bf16")) == 38 * SBH  # 2 fp32 + 15 half
    assert layer_activation_bytes(tiny(tp=2)) == (8 + 4 * 2 + 4 * 13 / 2) * SBH  # 13 of 17 split
    assert layer_activation_bytes(tiny(recompute_activations=True)) == 4 * SBH  # the input only


def test_activations_head_recompute_and_pipeline() -> None:
    head = 4 * (2 * SBH + 3 * 4 * 128 * 4096)  # final LN in/out + three fp32 (b, s, V)
    assert activation_bytes(tiny()) == 4 * 68 * SBH + head
    # recompute: 4 inputs kept; the head's backward (bigger here) ends before a block is rebuilt
    assert activation_bytes(tiny(recompute_activations=True)) == 4 * 4 * SBH + head
    # 1F1B on the first of 2 stages: 2 layers x min(pp, M) = 2 micro-batches; GPipe keeps all 8
    assert activation_bytes(tiny(pp=2, num_micro_batches=8)) == 2 * 68 * SBH * 2
    assert activation_bytes(tiny(pp=2, num_micro_batches=8, pipeline_schedule="gpipe")) == 2 * 68 * SBH * 8


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
    assert e.peak() == 4 * n + 8 * n + e.activations  # steady state: Adam's state is there
    assert e.peak(first_iteration=True) == 4 * n + e.activations
    assert e.peak(accumulating=True) == 16 * n + e.activations
    big_model = estimate(MemorySetup(2, 1024, 8, 8, 128, 1))  # tiny activations: the step wins
    assert big_model.peak() == big_model.parameters + big_model.gradients + big_model.optimizer_state


def test_bad_setups_fail_with_the_values() -> None:
    with pytest.raises(ValueError, match="fp8"):
        tiny(precision="fp8")
    with pytest.raises(ValueError, match="zero stage 4"):
        tiny(zero_stage=4)
    with pytest.raises(ValueError, match="layers 4 must divide by pp 3"):
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
