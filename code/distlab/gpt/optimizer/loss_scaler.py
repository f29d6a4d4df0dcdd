"""Dynamic loss scaling for fp16 (the run's precision itself is decided in ``precision.py``).

fp16 holds magnitudes in [6e-8, 65504]: small gradients underflow to 0 unless the loss is
multiplied by a scale ``S`` before backward (gradients are then ``S g``, divided by ``S``
before the step). Megatron's dynamic rule, with window ``W`` and hysteresis ``H``::

    any grad inf/nan on any rank  ->  skip the step; after H such overflows S <- max(S / 2, S_min)
    W clean steps in a row        ->  S <- 2 S  (and hysteresis is restored)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class DynamicLossScaler:
    """Megatron's ``DynamicGradScaler``: grow after ``window`` clean steps, back off on overflow."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float = 1.0,
        window: int = 1000,
        hysteresis: int = 2,
        growth: float = 2.0,
        backoff: float = 0.5,
    ) -> None:
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError(f"loss scales must be > 0: initial {initial_scale}, min {min_scale}")
        self.scale, self.min_scale, self.window = float(initial_scale), float(min_scale), window
        self.hysteresis, self.growth, self.backoff = hysteresis, growth, backoff
        self.hysteresis_left, self.clean_steps = hysteresis, 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
        else:
            self.clean_steps += 1
            if self.clean_steps == self.window:
                self.clean_steps, self.hysteresis_left = 0, self.hysteresis
                self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.clean_steps, self.hysteresis_left = (
            sd["scale"],
            sd["clean_steps"],
            sd["hysteresis_left"],
        )


@torch.no_grad()
def unscale_and_check(
    params: list[nn.Parameter], scale: float, group: dist.ProcessGroup | None = None
) -> bool:
    """Divide gradients by ``scale`` in place; True if any gradient on any rank is inf or nan."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros((), device=device)
    if grads:
        torch._foreach_mul_(grads, 1.0 / scale)
        found = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item())
