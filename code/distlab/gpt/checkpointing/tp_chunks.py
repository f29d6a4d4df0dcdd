"""Where a tensor-parallel rank's tensors lie in the whole tensor, for ``--ckpt-format torch_dist``.

The hand-written tensor parallelism gives rank ``r`` of ``p`` a plain tensor of the parameter's
name: :func:`~distlab.gpt.tensor_parallel.layers.shard` of the one-process tensor ``W`` (N along
``partition_dim``) in ``stride`` blocks, each cut in ``p``. Saved as it is, DCP would take the ``p``
different slices for copies of one tensor. Here each becomes a ``CheckpointableTensor`` (DCP's
protocol: the local tensor with ``global_shape``, and per chunk its ``global_offsets``,
``local_offsets`` and ``local_sizes``), the chunks of rank ``r`` being, for ``s < stride`` and
``n = N / (stride p)``::

    local rows [s n, (s + 1) n)  ->  global rows [s N / stride + r n, s N / stride + (r + 1) n)

(rows: along ``partition_dim``). ``stride`` 1 is one chunk, the r-th of p; SwiGLU's fc1
(``stride`` 2, rank r holds ``[gate_r; up_r]``) is two, ``gate_r`` in the gate half and ``up_r``
in the up half, so the checkpoint holds the one-process ``[gate; up]`` (Megatron's torch_dist
writes its two ``ShardedTensor`` s so too). The fused qkv (with GQA too) and the vocabulary-parallel
embedding and output layer are contiguous splits (``stride`` 1). The whole shape does not depend on
p, so DCP reads a checkpoint of one tp into another (resharding), and ``dcp.load`` without a
process group into one process (``inference/course_checkpoint.py``). Replicated tensors (norms,
the row-parallel bias) and the replicas over dp and cp stay plain: DCP writes each chunk (each
``(name, global offset)``) once, whichever rank holds it.

Adam's moments (``state.<name>.exp_avg``, as ``flatten_optimizer_state_dict`` names them) have
their parameter's shape and follow it. The engine's own tensors are left as they are: each gets
an alias (``view_as``, the same storage: ``dcp.load`` writes into it) that carries the fields.
"""

from __future__ import annotations

import torch
from torch import nn

#: Flattened optimizer-state entries that have their parameter's shape (Adam's moments).
MOMENTS = ("exp_avg", "exp_avg_sq")


def chunked(tensor: torch.Tensor, dim: int, stride: int, p: int, r: int) -> torch.Tensor:
    """An alias of rank ``r``'s shard ``tensor`` (N / p along ``dim``) naming its ``stride``
    chunks' places in the whole tensor (N along ``dim``), as DCP's ``CheckpointableTensor``."""
    local = list(tensor.shape)
    n = local[dim] // stride  # one chunk's rows: N / (stride p)
    whole = [*local[:dim], local[dim] * p, *local[dim + 1 :]]
    alias = tensor.view_as(tensor)
    alias.global_shape = tuple(whole)
    alias.global_offsets = tuple(_at(len(local), dim, s * n * p + r * n) for s in range(stride))
    alias.local_offsets = tuple(_at(len(local), dim, s * n) for s in range(stride))
    alias.local_sizes = tuple(
        tuple(n if i == dim else size for i, size in enumerate(local)) for _ in range(stride)
    )
    return alias


def _at(ndim: int, dim: int, offset: int) -> tuple[int, ...]:
    return tuple(offset if i == dim else 0 for i in range(ndim))


def _split(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The split parameters' names -> (partition_dim, partition_stride); DTensors (``--tensor-
    parallel-impl dtensor``) left out: DCP knows where their shards lie."""
    return {
        name: (p.partition_dim, getattr(p, "partition_stride", 1))
        for name, p in model.named_parameters()
        if getattr(p, "partition_dim", None) is not None and type(p.data) is torch.Tensor
    }


def place_model(state_dict: dict, model: nn.Module, p: int, r: int) -> dict:
    """``get_model_state_dict``'s ``{name: tensor}`` with every split tensor :func:`chunked` (tp > 1)."""
    if p == 1:
        return state_dict
    split = _split(model)
    return {k: chunked(v, *split[k], p, r) if k in split else v for k, v in state_dict.items()}


def place_optimizer(state_dict: dict, model: nn.Module, p: int, r: int) -> dict:
    """The flattened optimizer state dict with the moments of every split parameter :func:`chunked`."""
    if p == 1:
        return state_dict
    split = _split(model)
    out = {}
    for key, value in state_dict.items():
        kind, _, rest = key.partition(".")  # state.<name>.<moment> or param_groups.<name>.<option>
        name, _, leaf = rest.rpartition(".")
        moment = kind == "state" and leaf in MOMENTS and name in split
        out[key] = chunked(value, *split[name], p, r) if moment else value
    return out


def bucket_chunk(local: torch.Tensor, start: int, numel: int, p: int, r: int) -> torch.Tensor:
    """The distributed optimizer's ``local`` (real,): elements ``[start, start + real)`` of tp rank
    ``r``'s bucket of ``numel``, as row ``r`` of a (p, numel) whole; no chunk when ``real`` is 0
    (a rank holding only the bucket's padding)."""
    alias = local.view(1, -1)  # (1, real)
    alias.global_shape = (p, numel)
    alias.global_offsets = ((r, start),) if local.numel() else ()
    alias.local_offsets = ((0, 0),) if local.numel() else ()
    alias.local_sizes = ((1, local.numel()),) if local.numel() else ()
    return alias
