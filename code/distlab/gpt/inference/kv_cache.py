"""A key-value cache: each block's keys and values of the tokens seen so far, so that a new token
costs one position's work instead of the whole sequence's.

Without a cache, generating token t + 1 runs the model on all t tokens again: O(t) per token.
Attention is the only place where positions meet, and there the earlier positions enter only
through their keys and values, which do not change once computed (causal: position i never sees
a later one). So the step for a new token keeps, per block::

    K[0:P+T] = [K[0:P]; k_new]     V[0:P+T] = [V[0:P]; v_new]     (b, n, P + T, H/n) each
    y_new    = softmax(q_new K^T / sqrt(d) + M) V                   (b, n, T, H/n)

and every other layer runs on the T new positions only (T = 1 after the prompt). The buffers are
allocated once at ``max_length`` (T_max at most) and written in place: no re-allocation per token.
Per new token the GEMMs then cost the same at every length; only the q K^T and P V products grow,
by b n d multiply-adds per cached position (Megatron Core's static inference context,
``inference/contexts/static_context.py``, keeps a per-layer ``key_value_memory_dict`` of
preallocated buffers too; transformers' ``DynamicCache`` grows by concatenation).

The model calls only :meth:`KVCache.layer` and :meth:`LayerCache.update`
(``transformer/gpt_model.py``); the generation loop calls :meth:`KVCache.advance` after each forward.
"""

from __future__ import annotations

import torch
from torch import nn


class LayerCache:
    """One block's keys and values, (b, n, max_length, d) each, filled up to ``owner.length``."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.keys: torch.Tensor | None = None  # (b, n, max_length, d), allocated at the first update
        self.values: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values k, v (b, n, T, d) at positions P .. P + T - 1 (P: the
        cached length); return every key and value so far, (b, n, P + T, d) each (views)."""
        P, T = self.owner.length, k.shape[-2]
        if P + T > self.owner.max_length:
            raise ValueError(
                f"the KV cache holds {self.owner.max_length} positions: {P} cached + {T} new do not fit"
            )
        if self.keys is None:
            shape = (*k.shape[:-2], self.owner.max_length, k.shape[-1])
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape)
        self.keys[..., P : P + T, :] = k
        self.values[..., P : P + T, :] = v
        return self.keys[..., : P + T, :], self.values[..., : P + T, :]


class KVCache:
    """Every block's :class:`LayerCache` (made at a block's first forward) and the cached length P."""

    def __init__(self, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"a KV cache of {max_length} positions: give max_length >= 1")
        self.max_length = max_length
        self.length = 0  # P, positions every block has cached
        self._layers: dict[int, LayerCache] = {}

    def layer(self, block: nn.Module) -> LayerCache:
        """The cache of ``block`` (by identity: a block is one module, its cache one per run)."""
        return self._layers.setdefault(id(block), LayerCache(self))

    def advance(self, T: int) -> None:
        """After a forward of T new tokens through every block: P += T."""
        self.length += T

    def nbytes(self) -> int:
        """Bytes held by the buffers: 2 L b n max_length d x element size."""
        return sum(c.keys.nbytes + c.values.nbytes for c in self._layers.values() if c.keys is not None)
