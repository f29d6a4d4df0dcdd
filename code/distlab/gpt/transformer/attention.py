"""Causal self-attention with grouped-query heads, tensor-parallel (megatron-core's SelfAttention).

n query heads and g K/V heads (groups) of d = ``kv_channels`` channels; query head j reads the K/V
of group ``j // (n / g)`` (g = n: multi-head; g = 1: multi-query)::

    [q | k | v] = x W_qkv            W_qkv: (H, (n + 2g) d), output features ordered
                                     (group, [n/g query heads, k, v], d)
    o_j = softmax(q_j k_{j g/n}^T / sqrt(d) + causal) v_{j g/n}
    y   = [o_1 .. o_n] W_proj        W_proj: (n d, H)

The output order is megatron-core's (``get_query_key_value_tensors``), so a contiguous slice of
W_qkv's rows is a set of whole groups; with g = n it is (head, {q, k, v}, d).

**Tensor parallelism** (tp = t; ``qkv`` column-parallel, ``proj`` row-parallel), as megatron-core
allows the two cases, checked before a run (``validate_args``):

- t divides g: each rank holds g / t whole groups, n / t query heads and their K/V; nothing
  more is communicated than for multi-head attention.
- g divides t (g < t): K/V heads are replicated, each on t / g ranks. Each rank still holds 1 / t
  of W_qkv's rows; its output is all-gathered along the features (backward: reduce-scattered),
  each rank takes the slice of its group ``tp_rank // (t / g)`` and of that group's n / g query
  heads the n / t at ``tp_rank % (t / g)``.

RoPE (``rope.py``) rotates q and k after the split, at their global positions. PyTorch's fused
attention reads the g K/V heads as they are (``enable_gqa``: it keeps them, not n, for backward);
the explicit attention and ring attention see K/V repeated to one per query head
(``repeat_interleave``), so they store, and with ring attention send round the ring, n heads of
K/V as multi-head attention does. Every backend computes the same thing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from distlab.gpt.context_parallel.ring_attention import Ring, ring_attention
from distlab.gpt.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from distlab.gpt.tensor_parallel.mappings import all_gather_last_dim, group_rank, group_size
from distlab.gpt.tensor_parallel.rng_tracker import checkpoint, fork_if
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.recompute import EXPLICIT_BACKENDS
from distlab.gpt.transformer.rope import apply_rotary

if TYPE_CHECKING:  # the cache lives in inference/, above this layer: attention only calls it
    from distlab.gpt.inference.kv_cache import LayerCache


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + causal mask) V, spelt out: q, k, v (b, n, T, d) -> (b, n, T, d).

    Backward keeps the (b, n, T, T) probabilities, in fp32 (softmax's output; Megatron's
    attention_softmax_in_fp32) and, under autocast, their half copy that multiplies V: the
    scores term of Korthikanti's s b h (34 + 5as/h), which selective recomputation removes.
    """
    T, d = q.shape[-2], q.shape[-1]
    future = torch.full((T, T), float("-inf"), device=q.device).triu(1)  # (T, T): -inf above the diagonal
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d)) + future  # (b, n, T, T)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)  # stored for backward
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v)  # (b, n, T, d)


class SelfAttention(nn.Module):
    """Causal grouped-query attention; this rank computes ``n / tp`` query heads."""

    def __init__(self, cfg: GPTConfig, group, ring: Ring | None = None) -> None:
        super().__init__()
        self.ring = ring  # cp > 1: ring attention over the context-parallel group
        n, g, d = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        self.group, self.groups, self.per_group, self.head_dim = group, g, n // g, d
        tp = group_size(group)
        self.replicated = g < tp  # g divides tp: K/V heads replicated over tp / g ranks
        self.dropout = cfg.attention_dropout
        self.explicit = cfg.attention_backend in EXPLICIT_BACKENDS
        self.recompute = cfg.recompute_granularity == "selective"
        sp, bias = cfg.sequence_parallel, cfg.add_bias_linear
        self.qkv = ColumnParallelLinear(  # --add-qkv-bias: this bias alone (megatron-core's rule)
            cfg.hidden_size, (n + 2 * g) * d, group=group, bias=bias or cfg.add_qkv_bias, sequence_parallel=sp
        )
        self.proj = RowParallelLinear(n * d, cfg.hidden_size, group=group, bias=bias, sequence_parallel=sp)

    def forward(
        self, x: torch.Tensor, *, rotary: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """x (b, T, H) replicated over the tp ranks, or (b, T/tp, H) with sequence parallelism;
        ``rotary`` the RoPE angles (T, d_rot) of the T positions attention sees (None: no RoPE);
        ``cache`` (generation) the keys and values of the positions before them, to which the new
        ones are appended -> this rank's partial (b, T, H) reduced over tp (or reduce-scattered to
        (b, T/tp, H))."""
        q, k, v = self.query_key_value(x)  # (b, T, n/tp, d), (b, T, g_here, d) twice
        if rotary is not None:
            q, k = apply_rotary(q, rotary[:, None]), apply_rotary(k, rotary[:, None])  # (T, 1, d_rot) angles
        # each its own storage (a view kept for backward would keep the whole qkv output alive), in
        # (b, T, heads, d) order: the core attention's output is then the projection's input as it is
        q, k, v = (t.contiguous().transpose(1, 2) for t in (q, k, v))  # (b, heads, T, d)
        if cache is not None:  # generation: the T new queries against every key so far
            y = cached_attention(q, *cache.update(k, v))  # keys, values: (b, g_here, P + T, d)
        elif self.recompute and self.training:  # selective: keep q, k, v; rebuild the rest in backward
            y = checkpoint(self.core_attention, q, k, v)  # replays both random streams
        else:
            y = self.core_attention(q, k, v)
        y = y.transpose(1, 2).flatten(2)  # (b, T, n d / tp)
        return self.proj(y)  # partial (b, T, H) per rank, then g (all-reduce) or g-bar (reduce-scatter)

    def query_key_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's query heads and the K/V heads they read: (b, T, n/tp, d) and (b, T, g_here, d)."""
        qkv = self.qkv(x)  # f (or all-gather along T), then (b, T, (n + 2g) d / tp)
        if self.replicated:  # the whole output, then my group's [n/g q, k, v] slice
            qkv = all_gather_last_dim(qkv, self.group)  # (b, T, (n + 2g) d)
            ranks_per_group = group_size(self.group) // self.groups
            qkv = qkv.unflatten(-1, (self.groups, -1))[:, :, group_rank(self.group) // ranks_per_group]
        b, T = qkv.shape[:2]
        # groups here: as many as the output holds (DTensor's ColwiseParallel shards an unsharded layer)
        qkv = qkv.view(b, T, -1, self.per_group + 2, self.head_dim)  # (b, T, g_here, n/g + 2, d)
        q = qkv[:, :, :, : self.per_group].flatten(2, 3)  # (b, T, g_here n/g, d)
        k, v = qkv[:, :, :, self.per_group], qkv[:, :, :, self.per_group + 1]  # (b, T, g_here, d)
        if self.replicated:  # of the group's n/g query heads, my n/tp
            share = self.per_group * self.groups // group_size(self.group)
            first = group_rank(self.group) % (group_size(self.group) // self.groups) * share
            q = q[:, :, first : first + share]
        return q, k, v

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(Q K^T / sqrt(d)) V, causal: q (b, n/tp, T, d), k and v (b, g_here, T, d) ->
        (b, n/tp, T, d) (T / cp queries against all T keys with context parallelism)."""
        repeat = q.shape[1] // k.shape[1]  # query heads per K/V head here
        p = self.dropout if self.training else 0.0
        if not self.explicit and self.ring is None:  # the fused kernel reads the grouped K/V itself
            with fork_if(p > 0):  # this rank's heads: masks from the model-parallel stream (Megatron's)
                return F.scaled_dot_product_attention(  # stores no scores, and K/V of g_here heads
                    q, k, v, is_causal=True, dropout_p=p, enable_gqa=repeat > 1
                )
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # (b, n/tp, T, d)
        if self.ring is not None:
            return ring_attention(q, k, v, self.ring)
        with fork_if(p > 0):
            return unfused_attention(q, k, v, p)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + M) V for the last T of P + T positions: q (b, n, T, d), k and v
    (b, g, P + T, d) -> (b, n, T, d); query i sees keys 0 .. P + i (M: -inf elsewhere); each K/V
    head serves n / g query heads."""
    T, S = q.shape[-2], k.shape[-2]
    sees = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # (T, P + T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sees, enable_gqa=q.shape[1] > k.shape[1])
