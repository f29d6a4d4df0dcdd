"""Optimizer and Megatron's learning-rate schedule (gradient clipping is in ``distributed/gradients.py``).

The schedule counts samples, as Megatron's ``OptimizerParamScheduler`` does. After ``s`` samples
(``s = i x B`` at iteration ``i``, 1-based, global batch ``B``), warm-up ``W`` and decay ``D`` samples::

    s <= W          lr = lr_max * s / W
    W < s <= D      lr = lr_min + c(r) (lr_max - lr_min),  r = (s - W) / (D - W)
                    c = 1 - r (linear),  (1 + cos(pi r)) / 2 (cosine),  1 (constant)
    s > D           lr = lr_min

Iteration-based (``--train-iters``): ``D = --lr-decay-iters x B``, ``W = --lr-warmup-iters x B`` or
``int(--lr-warmup-fraction x --lr-decay-iters) x B``; sample-based (``--train-samples``):
``D = --lr-decay-samples`` (default ``--train-samples``), ``W = --lr-warmup-samples`` or
``--lr-warmup-fraction x D``. The same ``s`` gives the same rate either way when the samples are
the iterations times ``B``.

``--decoupled-lr`` / ``--decoupled-min-lr``: the input embedding and the output layer (Megatron's
``is_embedding_or_output_parameter``: the word embedding and the output weight, not the position
table) have their own ``lr_max`` / ``lr_min`` in the same warm-up and decay.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from distlab.gpt.arguments import PretrainArgs

#: The word embedding E and the output layer's weight (E's copy on the last stage): the
#: parameters Megatron tags ``is_embedding_or_output_parameter``.
EMBEDDING_OR_OUTPUT = ("wte.weight", "output_weight", "output_layer.weight")


def is_dtensor(t: object) -> bool:
    """``isinstance(t, DTensor)`` without importing ``torch.distributed.tensor`` (about 0.5 s, sympy
    included, in every process) in the runs that never build one: a DTensor exists only once that
    package is imported, by the native paths that make them."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def is_embedding_or_output(name: str, p: nn.Parameter) -> bool:
    return getattr(p, "is_embedding_or_output_parameter", False) or name in EMBEDDING_OR_OUTPUT


def group_key(name: str, p: nn.Parameter, args: PretrainArgs) -> tuple[bool, bool]:
    """``p``'s parameter group: (no weight decay: biases and norms, ``--decoupled-lr``'s: E and
    the output layer)."""
    no_decay = name.endswith(".bias") or ".ln" in name or name.startswith("ln")
    return no_decay, args.decoupled_lr is not None and is_embedding_or_output(name, p)


def make_optimizer(groups: dict[tuple[bool, bool], list], args: PretrainArgs) -> torch.optim.Optimizer:
    """AdamW (Megatron's ``adam`` decouples weight decay) or SGD over ``groups`` keyed by
    :func:`group_key`; each group carries its schedule's ``max_lr`` / ``min_lr``.

    Both fused (``fused=True``: one kernel over all parameters, on CPUs and GPUs alike): the
    default foreach AdamW reads every parameter's step count back to the host (two ``.item()``
    per parameter and step), and only a fused optimizer skips an update on the device
    (:func:`step_unless`). Not fused where the model mixes DTensor and plain parameters (DTensor
    tensor parallelism leaves the layers its plan does not name plain): the gradient norm, and so
    ``found_inf``, is then a plain tensor, which torch's fused kernel refuses beside DTensor
    parameters; that path keeps the foreach optimizer and its reads.
    """
    param_groups = [
        {
            "params": params,
            "weight_decay": 0.0 if no_decay else args.weight_decay,
            "max_lr": args.decoupled_lr if decoupled else args.lr,
            "min_lr": _decoupled_min_lr(args) if decoupled else args.min_lr,
        }
        for (no_decay, decoupled), params in sorted(groups.items())
    ]
    kinds = {is_dtensor(p) for g in param_groups for p in g["params"]}
    fused = None if len(kinds) > 1 else True
    if args.optimizer in ("adam", "adamw"):
        return torch.optim.AdamW(
            param_groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, fused=fused
        )
    return torch.optim.SGD(param_groups, lr=args.lr, momentum=args.sgd_momentum, fused=fused)


def _decoupled_min_lr(args: PretrainArgs) -> float:
    """Megatron keeps the common ``--min-lr`` when ``--decoupled-min-lr`` is not given."""
    return args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr


def build_optimizer(model: nn.Module, args: PretrainArgs) -> torch.optim.Optimizer:
    """:func:`make_optimizer` over the model's trainable parameters."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(group_key(name, p, args), []).append(p)
    return make_optimizer(groups, args)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group runs torch's fused kernel (which takes ``found_inf``)."""
    return all(group.get("fused") for group in optimizer.param_groups)


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` unless ``found_inf`` (a 0-d bool tensor), decided where it lives.

    A fused optimizer takes the flag as ``found_inf`` (as ``torch.amp.GradScaler`` hands it):
    its kernel leaves parameters, moments and step count alone when it is 1, without the host
    reading it (a ``DistributedOptimizer``'s torch optimizer over its shards alike). Any other
    optimizer (one built outside ``build_optimizer``) cannot: the flag is read (one
    synchronisation) and the step skipped on the host.
    """
    if not is_fused(optimizer):
        if not found_inf.item():
            optimizer.step()
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer of a DistributedOptimizer
    inner.found_inf = found_inf.float()
    try:
        optimizer.step()
    finally:
        del inner.found_inf


class LRSchedule:
    """Megatron's warm-up + decay schedule as a pure function of the samples consumed."""

    def __init__(self, args: PretrainArgs) -> None:
        self.max_lr, self.min_lr, self.style = args.lr, args.min_lr, args.lr_decay_style
        self.batch = args.global_batch_size or 1  # set by validate_args; 1 for bare arguments
        if args.train_samples is not None:
            self.decay_samples = args.lr_decay_samples or args.train_samples
            if args.lr_warmup_fraction is not None:
                self.warmup_samples = args.lr_warmup_fraction * self.decay_samples
            else:
                self.warmup_samples = args.lr_warmup_samples
        else:
            decay_iters = args.lr_decay_iters or args.train_iters
            if args.lr_warmup_fraction is not None:
                warmup_iters = int(args.lr_warmup_fraction * decay_iters)
            else:
                warmup_iters = args.lr_warmup_iters
            self.decay_samples, self.warmup_samples = decay_iters * self.batch, warmup_iters * self.batch

    def at_samples(self, samples: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """The rate after ``samples`` samples, for a group's ``max_lr`` / ``min_lr`` (default the run's)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup_samples > 0 and samples <= self.warmup_samples:
            return max_lr * samples / self.warmup_samples
        if self.style == "constant":
            return max_lr
        if samples > self.decay_samples:
            return min_lr
        ratio = (samples - self.warmup_samples) / max(1, self.decay_samples - self.warmup_samples)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def __call__(self, iteration: int) -> float:
        """The run's rate at ``iteration`` (1-based): after ``iteration x B`` samples."""
        return self.at_samples(iteration * self.batch)

    def apply(self, optimizer: torch.optim.Optimizer, iteration: int) -> float:
        """Set every group's rate for ``iteration``; return the run's (the log line's)."""
        samples = iteration * self.batch
        for group in optimizer.param_groups:
            group["lr"] = self.at_samples(samples, group.get("max_lr"), group.get("min_lr"))
        return self.at_samples(samples)
