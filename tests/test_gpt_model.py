"""GPT model: seeded layout-independent initialisation, stage split, causality, recomputation."""

from __future__ import annotations

import pytest
import torch

from distlab.gpt.layout import Layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel

pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(60)]
CFG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=256, max_position_embeddings=16)


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (3, 16), generator=g)  # (B, T)
    return tokens, tokens.roll(-1, dims=1)


def test_init_is_a_function_of_the_seed_only():
    torch.manual_seed(123)
    a = GPTModel(GPTConfig(**CFG, seed=7))
    torch.manual_seed(456)  # the global RNG does not matter
    b = GPTModel(GPTConfig(**CFG, seed=7))
    c = GPTModel(GPTConfig(**CFG, seed=8))
    for k, v in a.state_dict().items():
        torch.testing.assert_close(v, b.state_dict()[k], rtol=0, atol=0)
    assert not torch.equal(
        a.state_dict()["layers.0.attn.qkv.weight"], c.state_dict()["layers.0.attn.qkv.weight"]
    )
    std = a.state_dict()["layers.2.mlp.fc2.weight"].std().item()
    assert std == pytest.approx(0.02 / (2 * 4) ** 0.5, rel=0.1)  # scaled output-layer init
    assert torch.equal(a.state_dict()["layers.1.ln1.weight"], torch.ones(32))


def test_two_pipeline_stages_hold_and_compute_the_same_model():
    cfg = GPTConfig(**CFG, seed=3)
    full = GPTModel(cfg)
    layout = Layout(world_size=2, tp=1, pp=2)
    first, last = GPTModel(cfg, ParallelState(layout, rank=0)), GPTModel(cfg, ParallelState(layout, rank=1))
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert not hasattr(first, "ln_f") and not hasattr(last, "wte")
    ref = full.state_dict()
    for stage in (first, last):
        for k, v in stage.state_dict().items():
            torch.testing.assert_close(v, ref["wte.weight" if k == "output_weight" else k], rtol=0, atol=0)
    tokens, labels = batch()
    hidden = first(tokens)  # (B, T, h)
    last.set_input_tensor(hidden)
    torch.testing.assert_close(last(None, labels), full(tokens, labels))


def test_attention_is_causal_and_loss_starts_near_uniform():
    model = GPTModel(GPTConfig(**CFG))
    tokens, labels = batch()
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)  # logits (B, T, V)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert model(tokens, labels).mean().item() == pytest.approx(
        torch.log(torch.tensor(256.0)).item(), abs=0.1
    )


def test_recomputation_gives_the_same_gradients():  # every mode and backend: tests/test_gpt_recompute.py
    tokens, labels = batch(1)
    grads = []
    for recompute in (
        {},
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ):
        model = GPTModel(GPTConfig(**CFG, **recompute, seed=1))
        model(tokens, labels).mean().backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    for k, g in grads[0].items():
        torch.testing.assert_close(grads[1][k], g)


@pytest.mark.parametrize(
    "precision, fp32_residual, residual",
    [("bf16", False, torch.bfloat16), ("bf16", True, torch.float32), ("fp16", False, torch.float16),
     ("fp32", False, torch.float32)],
)  # fmt: skip
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_residual_stream_dtype_follows_fp32_residual_connection(
    precision: str, fp32_residual: bool, residual: torch.dtype, normalization: str
) -> None:
    """Under autocast (--bf16 / --fp16) every block's input, the residual stream, is in the
    training dtype, and in fp32 with --fp32-residual-connection (Megatron's); its norms return
    the compute dtype either way, its output keeps the input's dtype; fp32 runs are fp32 throughout."""
    model = GPTModel(GPTConfig(**CFG, normalization=normalization, fp32_residual_connection=fp32_residual))
    seen: dict[str, list[torch.dtype]] = {"in": [], "ln": [], "out": []}
    for block in model.layers.values():
        block.register_forward_pre_hook(
            lambda m, args, kw: seen["in"].append(args[0].dtype), with_kwargs=True
        )
        block.register_forward_hook(lambda m, args, out: seen["out"].append(out.dtype))
        for norm in (block.ln1, block.ln2):
            norm.register_forward_hook(lambda m, args, out: seen["ln"].append(out.dtype))
    amp = torch.float16 if precision == "fp16" else torch.bfloat16
    tokens, labels = batch()
    with torch.autocast("cpu", dtype=amp, enabled=precision != "fp32"):
        loss = model(tokens, labels).mean()
    loss.backward()
    compute = torch.float32 if precision == "fp32" else amp
    assert seen == {"in": [residual] * 4, "ln": [compute] * 8, "out": [residual] * 4}
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
