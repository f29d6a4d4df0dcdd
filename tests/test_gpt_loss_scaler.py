"""fp16 dynamic loss scaling: Megatron's window/hysteresis rule, and a skipped step leaves weights alone."""

from __future__ import annotations

import pytest
import torch

from distlab.gpt.layout import Layout
from distlab.gpt.optimizer.loss_scaler import DynamicLossScaler, unscale_and_check
from distlab.gpt.optimizer.precision import Precision
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training.training import LocalBackend, train_step
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel

pytestmark = [pytest.mark.engine_fast, pytest.mark.timeout(60)]


def test_hysteresis_then_backoff_and_growth_after_window():
    s = DynamicLossScaler(1024.0, min_scale=256.0, window=3, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 1024.0  # first overflow absorbed by hysteresis
    s.update(found_inf=True)
    assert s.scale == 512.0
    s.update(found_inf=True)
    s.update(found_inf=True)
    assert s.scale == 256.0  # floor
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 512.0 and s.hysteresis_left == 2
    restored = DynamicLossScaler(1.0)
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def test_unscale_divides_and_detects_inf():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([2.0, 4.0, 8.0]), torch.tensor([1.0, 1.0])
    assert not unscale_and_check([a, b], 2.0)
    torch.testing.assert_close(a.grad, torch.tensor([1.0, 2.0, 4.0]))
    b.grad = torch.tensor([1.0, float("inf")])
    assert unscale_and_check([a, b], 1.0)


def test_overflowing_fp16_step_is_skipped_and_weights_kept():
    torch.manual_seed(0)
    cfg = GPTConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=128, max_position_embeddings=16
    )
    state = ParallelState(Layout(1), rank=0)
    model = GPTModel(cfg, state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 128, (2, 16))
    batches = [(tokens, tokens.roll(-1, 1))]
    amp = lambda: Precision("fp16").autocast(torch.device("cpu"))  # noqa: E731
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = DynamicLossScaler(2.0**40, window=1000, hysteresis=1)
    backend = LocalBackend(model, opt, state, clip_grad=1.0, scaler=scaler)
    result = train_step(backend, batches, state=state, autocast=amp)
    assert result.skipped and result.grad_norm is None and scaler.scale == 2.0**39
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    scaler.scale = 2.0**8
    result = train_step(backend, batches, state=state, autocast=amp)
    assert not result.skipped and result.grad_norm > 0 and scaler.scale == 2.0**8
    assert not torch.equal(model.state_dict()["layers.0.attn.qkv.weight"], before["layers.0.attn.qkv.weight"])


class _HugeLoss(GPTModel):
    """The GPT with its per-token loss times 1e21: finite fp32 gradients of ~1e19 and more, whose
    squared norm overflows fp32 (max 3.4e38) although no gradient is inf or nan."""

    def forward(self, tokens, labels=None, chunk=0):
        return super().forward(tokens, labels, chunk) * 1e21


def test_fp16_step_with_a_nonfinite_norm_is_reported_skipped():
    """The unscaled gradients pass the inf / nan check, their norm does not: the update is not
    applied, and the step must say so (it was reported as taken, and counted as not skipped)."""
    cfg = GPTConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=128, max_position_embeddings=16
    )
    state = ParallelState(Layout(1), rank=0)
    model = _HugeLoss(cfg, state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = DynamicLossScaler(1.0, window=1000, hysteresis=1)  # fp32 compute: S = 1 keeps S g finite
    backend = LocalBackend(model, opt, state, clip_grad=1.0, scaler=scaler)
    result = train_step(backend, [(tokens, tokens.roll(-1, 1))], state=state)
    grads = [p.grad for p in model.parameters()]
    assert all(torch.isfinite(g).all() for g in grads) and max(float(g.abs().max()) for g in grads) > 1e19
    assert result.nan and not torch.isfinite(torch.as_tensor(result.grad_norm))  # inf, as measured
    assert result.skipped, "no update was applied, but the step is reported as not skipped"
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
