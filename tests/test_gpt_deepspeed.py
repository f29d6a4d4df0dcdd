"""DeepSpeed ZeRO on the course's GPT: batch rule, layout refusal, and every stage against DDP.

The stage test spawns one group of 2 gloo ranks (DeepSpeed's import and start-up cost seconds on
2 cores) and trains the same tiny GPT on the same micro-batches, 3 steps of 2 accumulated
micro-batches each, with plain DDP and with ZeRO 0, 1, 2, 3, 2 + CPU offload and 3 + CPU offload.
Every stage is the same arithmetic reordered (reduce-scatter + all-gather instead of
all-reduce), so the losses agree to fp32 rounding: rtol 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distlab.distributed import DistContext
from distlab.gpt.deepspeed.config import load_config, refuse_model_parallel
from distlab.gpt.layout import Layout
from tests.conftest import run_gloo

STAGES = [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)]
MICRO, ACCUM, WORLD, STEPS, VOCAB, SEQ = 2, 2, 2, 3, 256, 32


def test_batch_rule_names_all_four_numbers(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(ValueError) as err:
        load_config(path, micro_batch_size=4, accumulation_steps=2, world_size=2)
    msg = str(err.value)
    for part in ("train_batch_size 32", "train_micro_batch_size_per_gpu 4", "gradient_accumulation_steps 2",
                 "world size 2 = 16", str(path)):  # fmt: skip
        assert part in msg, msg


def test_config_filled_from_the_run_and_stage_overridden(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    cfg = load_config(
        path, micro_batch_size=4, accumulation_steps=2, world_size=2, zero_stage=3, clip_grad=1.0
    )
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"]) == (16, 4)
    assert (cfg["gradient_accumulation_steps"], cfg["zero_optimization"]["stage"]) == (2, 3)
    assert cfg["gradient_clipping"] == 1.0
    with pytest.raises(ValueError, match="ZeRO stage 5"):
        load_config(path, micro_batch_size=4, accumulation_steps=2, world_size=2, zero_stage=5)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="--deepspeed_config"):
        load_config(path, micro_batch_size=4, accumulation_steps=2, world_size=2)


def test_half_precision_sections_refused_with_the_engine_flags() -> None:
    run = dict(micro_batch_size=4, accumulation_steps=1, world_size=2)
    fp16 = {"enabled": True, "initial_scale_power": 10, "loss_scale_window": 1000, "hysteresis": 2}
    with pytest.raises(
        ValueError, match=r'enables "fp16": .* initial_scale_power p is --initial-loss-scale 2\^p'
    ):
        load_config({"fp16": fp16}, **run)
    with pytest.raises(ValueError, match='enables "bf16"'):
        load_config({"bf16": {"enabled": True}}, **run)
    assert load_config({"fp16": {**fp16, "enabled": False}}, **run)["fp16"]["initial_scale_power"] == 10


def test_model_parallel_refused() -> None:
    refuse_model_parallel(1, 1)
    with pytest.raises(
        ValueError, match="--tensor-model-parallel-size 2 and --pipeline-model-parallel-size 1"
    ):
        refuse_model_parallel(2, 1)


def _batches(rank: int) -> list:
    """This rank's two micro-batches, the same every step (so that the loss must fall)."""
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(ACCUM):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))  # (m, s) each
    return out


def _model_and_optimizer():
    from distlab.gpt.optimizer.optimizer import build_optimizer
    from distlab.gpt.optimizer.optimizer_config import OptimizerConfig
    from distlab.gpt.transformer.config import GPTConfig
    from distlab.gpt.transformer.gpt_model import GPTModel

    model = GPTModel(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                               max_position_embeddings=SEQ, seed=7))  # fmt: skip
    return model, build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.01))


def _worker(ctx: DistContext, out: str) -> None:
    from distlab.gpt.deepspeed import engine as dse
    from distlab.gpt.parallel_state import ParallelState
    from distlab.gpt.training.training import LocalBackend, train_step

    rank = ctx.rank
    state = ParallelState.build(Layout(WORLD))
    model, opt = _model_and_optimizer()
    # the engine's own data parallelism: one flat all-reduce of the gradients, what DDP computes
    local = LocalBackend(model, opt, state, clip_grad=1.0)
    losses = {"ddp": [float(train_step(local, _batches(rank), state=state).loss) for _ in range(STEPS)]}
    memory = {}
    for stage, offload in STAGES:
        zero = {"stage": stage}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
            if stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        cfg = load_config({"zero_optimization": zero}, micro_batch_size=MICRO, accumulation_steps=ACCUM,
                              world_size=WORLD, clip_grad=1.0)  # fmt: skip
        engine = dse.initialize(*_model_and_optimizer(), cfg)
        name = f"zero{stage}" + ("_offload" if offload else "")
        backend = dse.DeepSpeedBackend(engine)  # the same step loop, DeepSpeed's hooks
        losses[name] = [float(train_step(backend, _batches(rank), state=state).loss) for _ in range(STEPS)]
        memory[name] = dse.zero_memory_stats(engine)
        memory[name]["full"] = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                   for p in engine.module.parameters())  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps({"losses": losses, "memory": memory}))


def test_zero_stages_match_ddp(tmp_path: Path) -> None:
    run_gloo(_worker, WORLD, str(tmp_path), timeout_s=120)
    result = json.loads((tmp_path / "rank0.json").read_text())
    ddp = result["losses"]["ddp"]
    assert len(ddp) == STEPS and ddp[-1] < ddp[0]  # it trains
    for name, losses in result["losses"].items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp), rtol=1e-5, atol=0, msg=name)
    mem = result["memory"]
    n = mem["zero0"]["full"]
    assert mem["zero0"]["optimizer_state"] >= 8 * n  # exp_avg + exp_avg_sq of every parameter
    for name in ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"):
        assert 8 * n / WORLD <= mem[name]["optimizer_state"] < 8 * n / WORLD + 64, name  # one shard (+ steps)
    assert mem["zero2"]["parameters"] == 4 * n  # stages 1 and 2 keep every parameter
    assert 4 * n / WORLD <= mem["zero3"]["parameters"] <= 4 * n / WORLD + 64  # stage 3: one shard
