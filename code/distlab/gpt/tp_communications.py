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

__all__ = [
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


class _CopyToTensorParallel(torch.autograd.Function):
    """``f``: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension; all-gather in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_last(grad, ctx.group), None


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather the last dimension; keep this rank's slice in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split_last(grad, ctx.group), None


def copy_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``f``: Y = X forward, dX = sum over the group of dY backward."""
    return x if group_size(group) == 1 else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``g``: Y = sum over the group of X forward, dX = dY backward."""
    return x if group_size(group) == 1 else _ReduceFromTensorParallel.apply(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Y = X[..., r*H_p:(r+1)*H_p] forward, all-gather backward; (..., H) -> (..., H_p)."""
    return x if group_size(group) == 1 else _ScatterToTensorParallel.apply(x, group)


def gather_from_tensor_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Y = [X_1, ..., X_p] (last dim) forward, keep own slice backward; (..., H_p) -> (..., H)."""
    return x if group_size(group) == 1 else _GatherFromTensorParallel.apply(x, group)
