"""Optimizer, Megatron's learning-rate schedule and global gradient-norm clipping.

Learning rate at iteration ``i`` (1-based), warm-up ``W`` and decay ``D`` iterations::

    i <= W          lr = lr_max * i / W
    W < i <= D      lr = lr_min + c(r) (lr_max - lr_min),  r = (i - W) / (D - W)
                    c = 1 - r (linear),  (1 + cos(pi r)) / 2 (cosine),  1 (constant)
    i > D           lr = lr_min

with ``W = --lr-warmup-fraction x D`` (or ``--lr-warmup-iters``) and ``D = --lr-decay-iters``.

The gradient norm is over the whole model, ``||g|| = sqrt(sum_p ||g_p||^2)``: each rank adds the
squares of the gradients it owns and the sum is all-reduced over the model-parallel ranks
(tensor and pipeline groups). A parameter replicated over the tensor-parallel ranks (no
``partition_dim``) is counted on tp rank 0 only; the copy of the tied embedding on the last
stage (``shared_embedding``) is not counted twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.parallel_state import ParallelState


def build_optimizer(model: nn.Module, args: PretrainArgs) -> torch.optim.Optimizer:
    """AdamW (Megatron's ``adam`` decouples weight decay) or SGD; no decay on biases and norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or ".ln" in name or name.startswith("ln") else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if args.optimizer in ("adam", "adamw"):
        return torch.optim.AdamW(
            groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps
        )
    return torch.optim.SGD(groups, lr=args.lr, momentum=args.sgd_momentum)


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


def grad_norm(params: Iterable[nn.Parameter], state: ParallelState | None) -> torch.Tensor:
    """Global L2 norm of the gradients (fp32 scalar), counted once per distinct parameter."""
    tp_rank = state.tp_rank if state is not None else 0
    pp = state.pp if state is not None else 1
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if getattr(p, "partition_dim", None) is None and tp_rank != 0:
            continue
        if getattr(p, "shared_embedding", False) and pp > 1:
            continue
        grads.append(p.grad.detach())
    if grads:
        total = torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()  # sum_p ||g_p||^2
    else:
        total = torch.zeros((), device=_collective_device())
    if state is not None:
        for group, size in ((state.tp_group, state.tp), (state.pp_group, state.pp)):
            if size > 1:
                dist.all_reduce(total, group=group)
    return total.sqrt()


def _collective_device() -> torch.device:
    """Where collectives of this rank's groups run: its GPU with nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def clip_gradients(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale all gradients by ``min(1, max_norm / norm)`` (no-op when ``max_norm`` is 0)."""
    if max_norm <= 0:
        return
    coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coeff.to(grads[0].device))
