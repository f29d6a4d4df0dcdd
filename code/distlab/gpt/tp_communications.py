"""The communication operators of tensor parallelism, as autograd functions taking the group.

Megatron-LM (Shoeybi et al., 2019, section 3) names two conjugate operators. With ``p`` ranks
in the tensor-parallel group:

================  ============================  ===============================
operator          forward                       backward
================  ============================  ===============================
``f`` (copy)      identity: Y = X               all-reduce: dX = sum_i dY_i
``g`` (reduce)    all-reduce: Y = sum_i X_i     identity: dX = dY
scatter           keep my slice of the last dim all-gather the slices
gather            all-gather the last dim       keep my slice
================  ============================  ===============================

``f`` stands where a replicated activation enters a tensor-parallel region (each rank computes
a different part of the gradient of X, so they must be summed); ``g`` where partial results
leave it. A ColumnParallelLinear followed by a RowParallelLinear needs exactly one ``f`` and one
``g`` per direction: the MLP and the attention block each cost one all-reduce forward and one
backward.

Every function is the identity when ``group`` is ``None`` or has one rank, so the same model
code runs unsharded. Shapes: ``(..., H)`` is any tensor whose last dimension is split,
``H_p = H / p`` is one rank's slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: A tensor-parallel process group; None (or one rank) means unsharded.
Group = dist.ProcessGroup | None

__all__ = [
    "Group",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "group_size",
    "group_rank",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 when there is no group (unsharded)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index inside ``group``; 0 when there is no group."""
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()  # all_reduce works in place; never touch autograd's buffer
    dist.all_reduce(out, group=group)
    return out


def _split_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    p = group_size(group)
    if p == 1:
        return x
    if x.shape[-1] % p:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {p}")
    return x.chunk(p, dim=-1)[group_rank(group)].contiguous()  # (..., H) -> (..., H_p)


def _gather_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    p = group_size(group)
    if p == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)  # p x (..., H_p) -> (..., H)


def _identity(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x.view_as(x)  # a view: autograd needs a new tensor


class _Conjugate(torch.autograd.Function):
    """One operator of the table: ``forward_fn`` on the way in, ``backward_fn`` on the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, forward_fn, backward_fn) -> torch.Tensor:
        ctx.group, ctx.backward_fn = group, backward_fn
        return forward_fn(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_fn(grad, ctx.group), None, None, None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``f``: Y = X forward, dX = sum over the group of dY backward."""
    return x if group_size(group) == 1 else _Conjugate.apply(x, group, _identity, _all_reduce)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``g``: Y = sum over the group of X forward, dX = dY backward."""
    return x if group_size(group) == 1 else _Conjugate.apply(x, group, _all_reduce, _identity)


def scatter_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Y = X[..., r*H_p:(r+1)*H_p] forward, all-gather backward; (..., H) -> (..., H_p)."""
    return x if group_size(group) == 1 else _Conjugate.apply(x, group, _split_last, _gather_last)


def gather_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Y = [X_1, ..., X_p] (last dim) forward, keep own slice backward; (..., H_p) -> (..., H)."""
    return x if group_size(group) == 1 else _Conjugate.apply(x, group, _gather_last, _split_last)
