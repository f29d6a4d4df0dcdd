"""Megatron-style tensor parallelism: linear layers and embedding split over ranks (the loss over
the vocabulary slices: ``cross_entropy.py``).

Notation (``distlab.gpt``'s legend): ``p`` ranks in the tensor-parallel group (``tp``), this
rank is ``r``; ``b`` micro-batch size, ``T`` sequence, ``H`` hidden, ``F`` MLP width, ``V``
padded vocabulary; a ``_p`` suffix is one rank's slice (``F_p = F / p``). The MLP is
``Y = GeLU(X A) C`` with ``A`` column-parallel and ``C`` row-parallel, so the only
communication is one ``f`` before ``A`` and one ``g`` after ``C`` (see
:mod:`distlab.gpt.tensor_parallel.mappings`). Attention splits its heads the same way: the fused qkv
projection is column-parallel (the model orders its output features by head, so a contiguous
slice of rows holds whole heads) and the output projection is row-parallel.

With ``sequence_parallel=True`` (``--sequence-parallel``, tp > 1) the activations between the
layers are this rank's ``T_p = T / p`` positions, (b, T_p, H): a column-parallel layer all-gathers
them (in ``f``'s place), a row-parallel layer and the embedding reduce-scatter their sums (in
``g``'s place), and a parameter applied to the shards (LayerNorms, the row-parallel bias, the
position table) gets a partial gradient, tagged ``sequence_parallel`` for ``distributed/gradients.py`` to sum.

With ``group=None`` (or one rank) every layer is the plain layer: the communication operators
are identities, so a tp = 1 run goes through the same code.

Weights are allocated, not initialised: :func:`shard` cuts an unsharded tensor, and each
layer's ``load_full_`` keeps this rank's slice of it. ``GPTModel``'s initialiser draws every
unsharded tensor from the seed and the parameter's name, so every layout starts from the same
model; the tests load the weights of a plain ``nn.Linear`` or ``nn.Embedding`` the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab.gpt.tensor_parallel.mappings import (
    Group,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    group_rank,
    group_size,
    linear_with_sequence_gather,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from distlab.log_line import LogLine

#: The start-up line of the vocabulary's padding (:func:`vocab_padding_message`, Megatron's wording).
VOCAB_PADDING = LogLine(
    "> padded vocab (size: {vocab_size:d}) with {dummy:d} dummy tokens (new size: {padded:d})"
)


def shard(full: torch.Tensor, dim: int, p: int, r: int, stride: int = 1) -> torch.Tensor:
    """Rank ``r``'s part of ``full`` along ``dim`` for ``p`` ranks: ``stride`` blocks, each cut in ``p``.

    ``stride=1``: the r-th of p contiguous chunks. ``stride=3`` on a fused ``[q; k; v]`` weight
    (dim 0) gives rank r ``[q_r; k_r; v_r]``. (N along dim) -> (N / p along dim).
    """
    blocks = full.unflatten(dim, (stride, full.shape[dim] // stride))  # (..., stride, N/stride, ...)
    return blocks.chunk(p, dim=dim + 1)[r].flatten(dim, dim + 1)  # (..., N/p, ...)


def unshard(pieces: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The inverse of :func:`shard`: the p ranks' parts, in rank order, back into the full tensor.
    (N / p along dim) x p -> (N along dim)."""
    blocks = [
        x.unflatten(dim, (stride, x.shape[dim] // stride)) for x in pieces
    ]  # (..., stride, N/(p stride), ...)
    return torch.cat(blocks, dim=dim + 1).flatten(dim, dim + 1)  # (..., N, ...)


def _mark_partitioned(param: nn.Parameter, dim: int, stride: int = 1) -> None:
    """Tag a sharded parameter as Megatron does: which dimension is split (read by the initialiser
    and by the gradient norm, which counts a replicated parameter once)."""
    param.partition_dim = dim
    param.partition_stride = stride


def mark_sequence_parallel(param: nn.Parameter) -> None:
    """Tag a replicated parameter applied to sequence shards (Megatron's ``sequence_parallel``
    attribute): each tp rank holds the gradient of its T / p positions, summed over the group."""
    param.sequence_parallel = True


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Smallest multiple of ``make_vocab_size_divisible_by x tp`` >= ``vocab_size`` (Megatron).

    The padded rows are real (trainable, never-targeted) entries of the embedding; since they
    enter the softmax, two layouts train the same model only when they pad to the same size.
    """
    if vocab_size < 1 or make_vocab_size_divisible_by < 1 or tp < 1:
        raise ValueError(
            f"vocab size {vocab_size}, --make-vocab-size-divisible-by "
            f"{make_vocab_size_divisible_by} and tensor-parallel size {tp} must be >= 1"
        )
    multiple = make_vocab_size_divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def vocab_padding_message(vocab_size: int, padded: int) -> str:
    """The start-up line that reports the padding."""
    return VOCAB_PADDING.format(vocab_size=vocab_size, dummy=padded - vocab_size, padded=padded)


def _init_linear(
    layer: nn.Module, in_features: int, out_features: int, group: Group, *, split_dim: int, bias: bool = True
) -> None:
    """Sizes, group, this rank's (out, in) weight slice split along ``split_dim`` (0: output
    features, by ``layer.stride`` blocks; 1: input features), and the bias (split with the
    output features, whole otherwise). Allocated, not initialised (see the module docstring)."""
    p, stride = group_size(group), layer.stride
    split = (out_features, in_features)[split_dim]
    if split % (p * stride):
        raise ValueError(
            f"{type(layer).__name__}: {('out', 'in')[split_dim]}_features {split} is not divisible by "
            f"tensor-parallel size {p}" + (f" x stride {stride} = {p * stride}" if stride > 1 else "")
        )
    layer.in_features, layer.out_features, layer.group = in_features, out_features, group
    shape = [out_features, in_features]
    shape[split_dim] //= p
    layer.weight = nn.Parameter(torch.empty(shape))
    _mark_partitioned(layer.weight, split_dim, stride)
    layer.bias = (
        nn.Parameter(torch.empty(out_features // p if split_dim == 0 else out_features)) if bias else None
    )
    if bias and split_dim == 0:
        _mark_partitioned(layer.bias, 0, stride)


class ColumnParallelLinear(nn.Module):
    """Y = XA + b, A = [A_1, ..., A_p] split by columns; rank r computes Y_r = X A_r + b_r.

    The input X (b, T, H_in) is replicated; ``f`` (identity forward, all-reduce backward) sums
    the p partial input gradients. With ``sequence_parallel`` X is (b, T_p, H_in), all-gathered
    along T forward and its gradient reduce-scattered backward. The output is (b, T, H_out_p), or
    the full (b, T, H_out) with ``gather_output=True``. PyTorch stores ``A^T``, so "columns of A" are rows of ``weight``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        gather_output: bool = False,
        stride: int = 1,
        group: Group,
        bias: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.gather_output, self.stride, self.sequence_parallel = gather_output, stride, sequence_parallel
        _init_linear(self, in_features, out_features, group, split_dim=0, bias=bias)

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of an unsharded weight (out, in) and bias (out,)."""
        p, r = group_size(self.group), group_rank(self.group)
        self.weight.copy_(shard(weight, 0, p, r, self.stride))
        if self.bias is not None and bias is not None:
            self.bias.copy_(shard(bias, 0, p, r, self.stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # (b, T_p, H_in), all-gathered along T
            y = linear_with_sequence_gather(x, self.weight, self.bias, self.group)  # (b, T, H_out_p)
        else:
            y = F.linear(copy_to_tensor_parallel(x, self.group), self.weight, self.bias)  # f, (b, T, H_out_p)
        return gather_from_tensor_parallel(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
            f"stride={self.stride}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """Y = XA + b, A = [A_1; ...; A_p] split by rows, X = [X_1, ..., X_p]; Y = sum_r X_r A_r + b.

    The input is (b, T, H_in_p), already split (the output of a ColumnParallelLinear), or the
    full (b, T, H_in) with ``input_is_parallel=False``. ``g`` (all-reduce forward, identity
    backward) sums the partial products; the bias is added once, after the sum, and is
    replicated (its gradient is the same on every rank). With ``sequence_parallel`` the sum is
    reduce-scattered along T instead (``g-bar``): the output is (b, T_p, H_out), and the bias,
    added to the shard, gets a partial gradient (tagged ``sequence_parallel``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        input_is_parallel: bool = True,
        group: Group,
        bias: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.input_is_parallel, self.stride, self.sequence_parallel = input_is_parallel, 1, sequence_parallel
        _init_linear(self, in_features, out_features, group, split_dim=1, bias=bias)
        if bias and sequence_parallel:
            mark_sequence_parallel(self.bias)

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's columns of an unsharded weight (out, in); the bias is whole."""
        p, r = group_size(self.group), group_rank(self.group)
        self.weight.copy_(shard(weight, 1, p, r))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.group)  # (b, T, H_in) -> (b, T, H_in_p)
        partial = F.linear(x, self.weight)  # (b, T, H_out), this rank's share of the sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel(partial, self.group)  # (b, T_p, H_out), g-bar
        else:
            y = reduce_from_tensor_parallel(partial, self.group)  # (b, T, H_out), g
        # the bias in y's dtype, as F.linear adds it under autocast: the compute dtype, not fp32's
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """Y[t] = E[x_t], E = [E_1; ...; E_p] split by vocabulary rows; Y = sum_r E_r[x_t] (masked).

    Rank r holds rows ``[r V_p, (r+1) V_p)``; a token outside them gives zeros there, and ``g``
    sums the p partial lookups (exactly one of which is non-zero); with ``sequence_parallel`` it
    reduce-scatters them along T (``g-bar``): (b, T) -> (b, T_p, H). ``num_embeddings`` must
    already be padded to a multiple of p (:func:`pad_vocab_size`).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        p, self.sequence_parallel = group_size(group), sequence_parallel
        if num_embeddings % p:
            raise ValueError(
                f"VocabParallelEmbedding: vocabulary {num_embeddings} is not divisible by "
                f"tensor-parallel size {p}: pad it with pad_vocab_size "
                f"(--make-vocab-size-divisible-by)"
            )
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.vocab_start = group_rank(group) * (num_embeddings // p)
        self.vocab_end = self.vocab_start + num_embeddings // p
        self.weight = nn.Parameter(torch.empty(num_embeddings // p, embedding_dim))
        _mark_partitioned(self.weight, 0)

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of an unsharded table (V, H)."""
        self.weight.copy_(shard(weight, 0, group_size(self.group), group_rank(self.group)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(tokens, self.weight)  # (b, T, H): the whole table is here
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)  # (b, T)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)  # (b, T), valid row indices
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (b, T, H)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel(y, self.group)  # (b, T_p, H)
        return reduce_from_tensor_parallel(y, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"


def parallel_lm_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    group: dist.ProcessGroup | None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """logits_r = h E_r^T: this rank's vocabulary slice of the logits (tied output layer).

    hidden (b, T, H) replicated, or (b, T_p, H) all-gathered along T with ``sequence_parallel``;
    weight (V_p, H) this rank's embedding rows -> (b, T, V_p).
    """
    if sequence_parallel:
        return linear_with_sequence_gather(hidden, weight, None, group)
    return F.linear(copy_to_tensor_parallel(hidden, group), weight)
