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
gather (used      all-gather the last dim       reduce-scatter the last dim
apart)
================  ============================  ===============================

The second gather is for an output each rank then uses differently (grouped-query attention with
fewer K/V groups than ranks takes its own group's slice, as megatron-core's
``all_gather_last_dim_from_tensor_parallel_region``): the gradients of the whole differ per rank,
so each rank's slice gets the sum of all of theirs.

**Sequence parallelism** (``--sequence-parallel``; Korthikanti et al., 2022, section 4.2.2):
outside the tensor-parallel GEMMs (LayerNorms, dropout, residual adds) each rank keeps ``T / p``
of the sequence, dimension 1 of this engine's ``(b, T, H)`` activations. All-reduce =
reduce-scatter + all-gather, so ``f`` and ``g`` are replaced by their sequence-parallel pair,
which moves the same bytes in different operations:

========================  ==================================  ===================================
operator                  forward                             backward
========================  ==================================  ===================================
``g`` (gather, in ``f``'s  all-gather dim 1:                   reduce-scatter dim 1:
place: before a column-   (b, T/p, H) -> (b, T, H)            dX_r = (sum_i dY_i)[r-th T/p]
parallel GEMM)
``g-bar`` (in ``g``'s     reduce-scatter dim 1:               all-gather dim 1
place: after a row-       Y_r = (sum_i X_i)[r-th T/p]
parallel GEMM)
========================  ==================================  ===================================

The gather is fused with the GEMM that follows it (:func:`linear_with_sequence_gather`, as
Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``): it keeps only the ``T / p``
shard for backward and all-gathers it again there, for the weight gradient. Storing the gathered
input would keep ``T``, not ``T / p``, of every GEMM input, which is most of the memory saved.

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
import torch.nn.functional as F

#: A tensor-parallel process group; None (or one rank) means unsharded.
Group = dist.ProcessGroup | None

__all__ = [
    "Group",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "all_gather_last_dim",
    "reduce_scatter_to_sequence_parallel",
    "linear_with_sequence_gather",
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


def _reduce_scatter_last(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    p = group_size(group)
    parts = [part.contiguous() for part in x.chunk(p, dim=-1)]  # p x (..., H_p)
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out  # (..., H_p): my slice of the sum


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    x = x.contiguous()  # (b, T/p, ...)
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=1)  # p x (b, T/p, ...) -> (b, T, ...)


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    p = group_size(group)
    if x.shape[1] % p:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by tensor-parallel size {p}")
    parts = [part.contiguous() for part in x.chunk(p, dim=1)]  # p x (b, T/p, ...)
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out  # (b, T/p, ...): my shard of the sum


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


def all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Y = [X_1, ..., X_p] (last dim) forward, reduce-scatter of dY backward; (..., H_p) -> (..., H)."""
    return x if group_size(group) == 1 else _Conjugate.apply(x, group, _gather_last, _reduce_scatter_last)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``g-bar``: Y_r = (sum over the group of X)[r-th T/p of dim 1] forward, all-gather backward;
    (b, T, ...) -> (b, T/p, ...)."""
    if group_size(group) == 1:
        return x
    return _Conjugate.apply(x, group, _reduce_scatter_sequence, _gather_sequence)


class _LinearWithSequenceGather(torch.autograd.Function):
    """Y = [X_1; ...; X_p] W^T + b: all-gather dim 1, then the GEMM; only X_r is saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):  # x (b, T/p, H_in), weight (H_out_p, H_in)
        ctx.group, ctx.has_bias, ctx.x_dtype = group, bias is not None, x.dtype
        if torch.is_autocast_enabled(x.device.type):  # gather and keep the half copy the GEMM reads
            x = x.to(torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_sequence(x, group), weight, bias)  # (b, T, H_out_p), autocast applies

    @staticmethod
    def backward(ctx, grad):  # grad (b, T, H_out_p), in the forward's compute dtype
        x, weight = ctx.saved_tensors
        total = _gather_sequence(x.to(grad.dtype), ctx.group)  # (b, T, H_in), gathered again
        grad_x = _reduce_scatter_sequence(grad @ weight.to(grad.dtype), ctx.group)  # (b, T/p, H_in)
        grad_2d = grad.flatten(0, -2)  # (b T, H_out_p)
        grad_w = (grad_2d.t() @ total.flatten(0, -2)).to(weight.dtype)  # (H_out_p, H_in)
        grad_b = grad_2d.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x.to(ctx.x_dtype), grad_w, grad_b, None


def linear_with_sequence_gather(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``g`` fused with its GEMM: all-gather the sequence (dim 1) forward, reduce-scatter dX backward.

    x (b, T/p, H_in) this rank's sequence shard, weight (H_out_p, H_in) -> (b, T, H_out_p). Backward
    all-gathers x again for dW (one more all-gather per GEMM, Megatron's trade) instead of keeping
    the (b, T, H_in) input alive from forward to backward.
    """
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    return _LinearWithSequenceGather.apply(x, weight, bias, group)
