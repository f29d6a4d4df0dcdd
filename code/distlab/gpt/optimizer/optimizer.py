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


def decays(name: str) -> bool:
    """Weight decay for every parameter but biases and norms (Megatron's default groups)."""
    return not (name.endswith(".bias") or ".ln" in name or name.startswith("ln"))


def make_optimizer(groups: tuple[list, list], args: PretrainArgs) -> torch.optim.Optimizer:
    """AdamW (Megatron's ``adam`` decouples weight decay) or SGD over (decayed, not decayed)."""
    decay, no_decay = groups
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optimizer in ("adam", "adamw"):
        return torch.optim.AdamW(
            groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps
        )
    return torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum)


def build_optimizer(model: nn.Module, args: PretrainArgs) -> torch.optim.Optimizer:
    """:func:`make_optimizer` over the model's trainable parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name) else no_decay).append(p)
    return make_optimizer((decay, no_decay), args)


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
