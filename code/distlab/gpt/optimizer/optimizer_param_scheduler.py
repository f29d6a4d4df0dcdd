"""Megatron's learning-rate schedule (megatron-core's ``optimizer_param_scheduler.py``).

The schedule counts samples, as Megatron's ``OptimizerParamScheduler`` does. After ``s`` samples
(``s = i x B`` at iteration ``i``, 1-based, global batch ``B``), warm-up ``W`` and decay ``D`` samples
(:class:`LRSchedule`'s ``lr_warmup_steps`` and ``lr_decay_steps``, Megatron's names)::

    s <= W          lr = lr_max * s / W
    W < s <= D      lr = lr_min + c(r) (lr_max - lr_min),  r = (s - W) / (D - W)
                    c = 1 - r (linear),  (1 + cos(pi r)) / 2 (cosine),  1 (constant)
    s > D           lr = lr_min

Iteration-based (``--train-iters``): ``D = --lr-decay-iters x B``, ``W = --lr-warmup-iters x B`` or
``int(--lr-warmup-fraction x --lr-decay-iters) x B``; sample-based (``--train-samples``):
``D = --lr-decay-samples`` (default ``--train-samples``), ``W = --lr-warmup-samples`` or
``--lr-warmup-fraction x D`` (``arguments/to_configs.py`` counts them). The same ``s`` gives the
same rate either way when the samples are the iterations times ``B``.

``--decoupled-lr`` / ``--decoupled-min-lr`` (``optimizer.py``'s parameter groups): a group's own
``max_lr`` / ``min_lr`` in the same warm-up and decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's warm-up + decay schedule as a pure function of the samples consumed; the fields
    are the arguments of megatron-core's ``OptimizerParamScheduler`` (its steps are samples)."""

    max_lr: float
    """The run's peak rate (a parameter group's own ``max_lr`` overrides it)."""
    min_lr: float
    """The run's rate after the decay (a group's own ``min_lr`` overrides it)."""
    lr_warmup_steps: float
    """W, samples of linear warm-up from 0."""
    lr_decay_steps: float
    """D, samples at which the decay ends (warm-up included)."""
    lr_decay_style: str = "linear"
    """constant, linear or cosine."""
    global_batch_size: int = 1
    """B, the samples of one iteration: iteration ``i`` is ``i x B`` samples."""

    def at_samples(self, samples: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The rate after ``samples`` samples, for a group's ``max_lr`` / ``min_lr`` (default the run's)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        warmup, decay = self.lr_warmup_steps, self.lr_decay_steps
        if warmup > 0 and samples <= warmup:
            return max_lr * samples / warmup
        if self.lr_decay_style == "constant":
            return max_lr
        if samples > decay:
            return min_lr
        ratio = (samples - warmup) / max(1, decay - warmup)
        coeff = 1.0 - ratio if self.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def __call__(self, iteration: int) -> float:
        """The run's rate at ``iteration`` (1-based): after ``iteration x B`` samples."""
        return self.at_samples(iteration * self.global_batch_size)

    def apply(self, optimizer: torch.optim.Optimizer, iteration: int) -> float:
        """Set every group's rate for ``iteration``; return the run's (the log line's)."""
        samples = iteration * self.global_batch_size
        for group in optimizer.param_groups:
            group["lr"] = self.at_samples(samples, group.get("max_lr"), group.get("min_lr"))
        return self.at_samples(samples)
