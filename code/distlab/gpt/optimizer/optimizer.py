"""Optimizer and Megatron's learning-rate schedule (gradient clipping is in ``distributed/gradients.py``).

Learning rate at iteration ``i`` (1-based), warm-up ``W`` and decay ``D`` iterations::

    i <= W          lr = lr_max * i / W
    W < i <= D      lr = lr_min + c(r) (lr_max - lr_min),  r = (i - W) / (D - W)
                    c = 1 - r (linear),  (1 + cos(pi r)) / 2 (cosine),  1 (constant)
    i > D           lr = lr_min

with ``W = --lr-warmup-fraction x D`` (or ``--lr-warmup-iters``) and ``D = --lr-decay-iters``.

"""

from __future__ import annotations

import math

import torch
from torch import nn

from distlab.gpt.arguments import PretrainArgs


def build_optimizer(model: nn.Module, args: PretrainArgs) -> torch.optim.Optimizer:
    """AdamW (Megatron's ``adam`` decouples weight decay) or SGD; no decay on biases and norms.

    Both fused (``fused=True``: one kernel over all parameters, on CPUs and GPUs alike): the
    default foreach AdamW reads every parameter's step count back to the host (two ``.item()``
    per parameter and step), and only a fused optimizer skips an update on the device
    (:func:`step_unless`).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or ".ln" in name or name.startswith("ln") else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optimizer in ("adam", "adamw"):
        return torch.optim.AdamW(
            groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, fused=True
        )
    return torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum, fused=True)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group runs torch's fused kernel (which takes ``found_inf``)."""
    return all(group.get("fused") for group in optimizer.param_groups)


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` unless ``found_inf`` (a 0-d bool tensor), decided where it lives.

    A fused optimizer takes the flag as ``found_inf`` (as ``torch.amp.GradScaler`` hands it):
    its kernel leaves parameters, moments and step count alone when it is 1, without the host
    reading it. Any other optimizer (one built outside ``build_optimizer``) cannot: the flag is
    read (one synchronisation) and the step skipped on the host.
    """
    if not is_fused(optimizer):
        if not found_inf.item():
            optimizer.step()
        return
    optimizer.found_inf = found_inf.float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


class LRSchedule:
    """Megatron's warm-up + decay schedule as a pure function of the iteration."""

    def __init__(self, args: PretrainArgs) -> None:
        self.max_lr, self.min_lr, self.style = args.lr, args.min_lr, args.lr_decay_style
        self.decay_iters = args.lr_decay_iters or args.train_iters
        if args.lr_warmup_fraction is not None:
            self.warmup_iters = int(args.lr_warmup_fraction * self.decay_iters)
        else:
            self.warmup_iters = args.lr_warmup_iters

    def __call__(self, iteration: int) -> float:
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if iteration > self.decay_iters:
            return self.min_lr
        ratio = (iteration - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def apply(self, optimizer: torch.optim.Optimizer, iteration: int) -> float:
        lr = self(iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
