"""GPT for one pipeline stage: pre-LayerNorm blocks, learned positions, tied embeddings.

For tokens ``x`` (b, T) (one micro-batch) and L blocks (notation: ``distlab.gpt``'s legend)::

    h_0     = E[x] + P[0:T]                                   E: (V, H), P: (T_max, H)
    a_l     = h_{l-1} + proj(attn(qkv(LN1(h_{l-1}))))         causal, heads of size H / n
    h_l     = a_l + fc2(gelu(fc1(LN2(a_l))))                  fc1: H -> F, fc2: F -> H
    logits  = LNf(h_L) E^T                                    (b, T, V), tied with E
    loss    = cross_entropy(logits, labels)                   per token, (b, T)

Tensor parallelism (``tensor_parallel/layers.py``): ``qkv`` and ``fc1`` are column-parallel, ``proj``
and ``fc2`` row-parallel, E is vocabulary-parallel and the loss is the vocabulary-parallel
cross-entropy of the (b, T, V / tp) logit slices. With tp = 1 these are the same layers with
no group: one code path for every layout. Sequence parallelism (``--sequence-parallel``) keeps
the residual stream, the LayerNorms and dropout on this rank's T / tp positions, (b, T / tp, H),
split along dim 1 from the embedding's reduce-scatter to the output layer's all-gather; only
attention and the MLP's GeLU see the whole sequence (on their H / tp slice). The qkv output features are ordered
``(head, {q,k,v}, head_dim)``, so a contiguous slice of rows is a set of whole heads.

Pipeline parallelism (``pipeline_parallel/schedules.py``): a stage holds the embedding only if it is the
first, blocks ``[pp_rank L / pp, (pp_rank + 1) L / pp)`` (keyed by their *global* index), and
the final LayerNorm + output head only if it is the last. Interleaved (``v = state.vp > 1``
chunks per rank): chunk ``c`` holds the ``L / (pp v)`` blocks of virtual stage ``c pp + pp_rank``,
``forward(..., chunk=c)`` runs them, the embedding before chunk 0 of the first stage, the head
after chunk ``v - 1`` of the last; all chunks are one module, so the optimizer, the gradient
reduction and the checkpoints see every chunk's parameters, by their global names.
A last stage that is not also the first holds its own copy of E (``output_weight``); the
initialiser makes it equal to the first stage's E (same name, same seed), and ``distributed/gradients.py``
sums the two gradients, so they stay equal.

Mixture of experts (``moe/moe_layer.py``, ``moe/expert_parallel.py``; ``GPTConfig.moe``): every block's MLP
becomes a router and E experts, split over the ep ranks of the layout's expert groups (and over
tp, etp = tp); each layer attaches its ``coeff l_aux`` to its output for backward (the returned
values stay the lm loss).

Context parallelism (``context_parallel/ring_attention.py``): with cp > 1 each rank holds T / cp tokens of
every sample (two of 2 cp chunks, their global positions from ``context_parallel.positions``)
and the core attention is :func:`~distlab.gpt.context_parallel.ring_attention.ring_attention` over the cp group;
every other layer is per token and needs nothing.

Memory (``transformer/recompute.py``): ``--attention-backend`` picks the core attention, PyTorch's fused
``scaled_dot_product_attention`` or :func:`unfused_attention` (which stores the (b, n, T, T)
probabilities); ``--recompute-granularity selective`` checkpoints the core attention of every
block, ``full`` checkpoints groups of whole blocks (:func:`~distlab.gpt.transformer.recompute.checkpoint_groups`).
Every choice computes the same loss.

Dropout (``tensor_parallel/rng_tracker.py``, Megatron's two random streams): what the tp ranks hold alike (the
(b, T, H) hidden states after ``g``, the embeddings' output) is dropped out with the default
stream, the same mask on every tp rank; what each holds alone (its heads' attention
probabilities; with SP its T / tp positions: the whole block and the embeddings' dropout) with
the model-parallel stream. Recomputation replays both.

Initialisation (:func:`init_parameters`, the only one): every unsharded tensor is drawn from a
generator seeded by ``(--seed, the parameter's global name)`` and cut with
``tensor_parallel.shard`` along its ``partition_dim``. Every layout starts from the same weights.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from distlab.gpt.context_parallel.ring_attention import Ring, positions, ring_attention, ring_of
from distlab.gpt.layout import context_dropout_error, raise_errors, sequence_parallel_error
from distlab.gpt.moe.moe_layer import MoEConfig, MoELayer
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    parallel_lm_logits,
    shard,
    vocab_parallel_cross_entropy,
)
from distlab.gpt.tensor_parallel.mappings import gather_from_tensor_parallel
from distlab.gpt.tensor_parallel.rng_tracker import checkpoint, fork_if
from distlab.gpt.transformer.recompute import (
    ATTENTION_BACKENDS,
    EXPLICIT_BACKENDS,
    checkpoint_groups,
    recompute_errors,
)

if TYPE_CHECKING:  # the cache lives in inference/, above this layer: the model only calls it
    from distlab.gpt.inference.kv_cache import KVCache, LayerCache


@dataclass
class GPTConfig:
    """Model shape and initialisation (arithmetic: params ~ 12 L H^2 + V H + T_max H)."""

    num_layers: int
    """L, transformer blocks in the whole model (all stages)."""
    hidden_size: int
    """H, the residual stream width."""
    num_attention_heads: int
    """n, heads per block; head size is H / n."""
    vocab_size: int
    """V, the padded vocabulary (a multiple of make-vocab-size-divisible-by x tp)."""
    max_position_embeddings: int
    """T_max, learned positions."""
    ffn_hidden_size: int | None = None
    """F, MLP width; 4H when None."""
    init_method_std: float = 0.02
    """std of the normal init; proj and fc2 use std / sqrt(2L) (GPT-2 / Megatron)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    recompute_granularity: str | None = None
    """None, "selective" (checkpoint the core attention) or "full" (checkpoint whole blocks)."""
    recompute_method: str | None = None
    """With full granularity: "uniform" (groups of N blocks) or "block" (the stage's first N)."""
    recompute_num_layers: int | None = None
    """N, with full granularity: 1 <= N <= L / pp."""
    attention_backend: str = "auto"
    """auto, flash, fused: ``F.scaled_dot_product_attention``; unfused, local: :func:`unfused_attention`."""
    seed: int = 1234
    layernorm_epsilon: float = 1e-5
    moe: MoEConfig | None = None
    """None: dense MLPs; else every block's MLP is a mixture of experts."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: activations outside the tp GEMMs split along T (needs tp > 1)."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention backend {self.attention_backend!r} must be one of {ATTENTION_BACKENDS}"
            )


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
    """Causal multi-head attention; this rank computes ``n / tp`` whole heads."""

    def __init__(self, cfg: GPTConfig, group, ring: Ring | None = None) -> None:
        super().__init__()
        self.ring = ring  # cp > 1: ring attention over the context-parallel group
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.dropout = cfg.attention_dropout
        self.explicit = cfg.attention_backend in EXPLICIT_BACKENDS
        self.recompute = cfg.recompute_granularity == "selective"
        sp = cfg.sequence_parallel
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, 3 * cfg.hidden_size, group=group, sequence_parallel=sp
        )
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, group=group, sequence_parallel=sp)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        # x: (b, T, H) replicated over the tp ranks, or (b, T/tp, H) with sequence parallelism
        qkv = self.qkv(x)  # f (or all-gather along T), then (b, T, 3H/tp)
        b, T, _ = qkv.shape
        # n/tp heads: as many as the output holds (DTensor's ColwiseParallel shards an unsharded layer)
        q, k, v = qkv.view(b, T, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        if cache is not None:  # generation: the T new queries against every key so far
            y = cached_attention(q, *cache.update(k, v))  # keys, values: (b, n/tp, P + T, H/n)
        elif self.recompute and self.training:  # selective: keep q, k, v; rebuild the rest in backward
            y = checkpoint(self.core_attention, q, k, v)  # replays both random streams
        else:
            y = self.core_attention(q, k, v)
        y = y.transpose(1, 2).flatten(2)  # (b, T, H/tp)
        return self.proj(y)  # partial (b, T, H) per rank, then g (all-reduce) or g-bar (reduce-scatter)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(Q K^T / sqrt(d)) V, causal: each (b, n/tp, T, H/n) -> (b, n/tp, T, H/n)
        (T / cp queries against all T keys with context parallelism)."""
        if self.ring is not None:
            return ring_attention(q, k, v, self.ring)
        p = self.dropout if self.training else 0.0
        with fork_if(p > 0):  # this rank's heads: masks from the model-parallel stream (Megatron's)
            if self.explicit:
                return unfused_attention(q, k, v, p)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # stores no scores


class MLP(nn.Module):
    """H -> F -> GELU -> H, with F split over the tp ranks."""

    def __init__(self, cfg: GPTConfig, group) -> None:
        super().__init__()
        sp = cfg.sequence_parallel
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, cfg.ffn, group=group, sequence_parallel=sp)
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden_size, group=group, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (b, T, H), or (b, T/tp, H) with SP
        y = F.gelu(self.fc1(x))  # f (or all-gather), then (b, T, F/tp): nothing between fc1 and fc2
        return self.fc2(y)  # partial (b, T, H) per rank, then g (all-reduce) or g-bar (reduce-scatter)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: per direction, one f and one g around attention and
    around the MLP, so 2 all-reduces forward and 2 backward when tp > 1. With sequence
    parallelism: 2 all-gathers and 2 reduce-scatters forward; backward 2 reduce-scatters and
    4 all-gathers (2 of them gather the GEMM inputs again for the weight gradients)."""

    def __init__(
        self, cfg: GPTConfig, group, state: ParallelState | None = None, ring: Ring | None = None
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attn = SelfAttention(cfg, group, ring)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        if cfg.moe is None:
            self.mlp = MLP(cfg, group)
        else:  # the experts of this rank's place in its expert-parallel group
            self.mlp = MoELayer(cfg.moe, cfg.hidden_size, cfg.ffn, state)
        self.drop = nn.Dropout(cfg.hidden_dropout)
        self.dropout = cfg.hidden_dropout > 0 or cfg.attention_dropout > 0
        #: The residual stream is this rank's T / tp positions (SP, this engine's or DTensor's,
        #: which sets it): its dropout draws from the model-parallel stream, as Megatron forks the
        #: whole block under SP. Else the hidden dropout after g draws from the default stream,
        #: the same mask on every tp rank, as the (b, T, H) it drops out is.
        self.sequence_parallel = cfg.sequence_parallel
        if cfg.sequence_parallel:
            for p in (*self.ln1.parameters(), *self.ln2.parameters()):
                mark_sequence_parallel(p)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        # (b, T, H) -> (b, T, H); T/tp with SP
        with fork_if(self.sequence_parallel and self.dropout and self.training):
            x = x + self.drop(self.attn(self.ln1(x), cache))
            return x + self.drop(self.mlp(self.ln2(x)))


class GPTModel(nn.Module):
    """The part of the GPT that lives on this rank's pipeline stage (all of it when pp = 1)."""

    def __init__(self, cfg: GPTConfig, state: ParallelState | None = None) -> None:
        super().__init__()
        self.cfg, self.state = cfg, state
        tp, pp, vp = (state.tp, state.pp, state.vp) if state is not None else (1, 1, 1)
        pp_rank = state.pp_rank if state is not None else 0
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp - 1
        self.tp_group = state.tp_group if tp > 1 else None  # None: every operator is the identity
        self.ring = ring_of(state)
        cp = state.cp if state is not None else 1
        raise_errors(  # the layout's rules (validate_args checks them before a run)
            context_dropout_error(cp, cfg.attention_dropout),
            sequence_parallel_error(cfg.sequence_parallel, tp),
        )
        self.sp_rank = state.tp_rank if cfg.sequence_parallel else 0  # which T/tp positions are here
        if self.is_first:
            self.wte = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, group=self.tp_group, sequence_parallel=cfg.sequence_parallel
            )
            self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)  # P: (T_max, H)
            self.drop = nn.Dropout(cfg.hidden_dropout)
        self.chunks, self.per_chunk = vp, cfg.num_layers // (pp * vp)
        errors = recompute_errors(
            cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers, self.per_chunk
        )
        if errors:
            raise ValueError("; ".join(errors))
        self.groups = checkpoint_groups(
            self.per_chunk, cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers
        )
        firsts = [(c * pp + pp_rank) * self.per_chunk for c in range(vp)]  # virtual stage c pp + pp_rank
        self.layers = nn.ModuleDict(
            {
                str(i): Block(cfg, self.tp_group, state, self.ring)
                for f in firsts
                for i in range(f, f + self.per_chunk)
            }
        )
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
            if not self.is_first:  # own copy of E: (V / tp, H), rows split as the first stage's
                self.output_weight = nn.Parameter(torch.empty(cfg.vocab_size // tp, cfg.hidden_size))
                self.output_weight.partition_dim = 0
                self.output_weight.init_name = "wte.weight"  # drawn as E: equal from the start
                self.output_weight.shared_embedding = True  # counted once by the gradient norm
            if cfg.sequence_parallel:
                mark_sequence_parallel(self.ln_f.weight)
                mark_sequence_parallel(self.ln_f.bias)
        if self.is_first and cfg.sequence_parallel:
            mark_sequence_parallel(self.wpe.weight)  # rank r adds (and differentiates) rows of its T/tp
        self.input_tensor: torch.Tensor | None = None  # hidden states from the previous stage
        init_parameters(self, cfg, state)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states (b, T, H), (b, T/tp, H) with SP, this stage starts from when it is not the first."""
        self.input_tensor = tensor

    def output_embedding(self) -> torch.Tensor:
        """E as the output layer uses it (this stage's own copy when it is not the first)."""
        return self.wte.weight if self.is_first else self.output_weight

    def tied_embedding(self) -> torch.Tensor | None:
        """E on the first and the last stage when they are different stages, else None: the
        weight whose two gradients ``gradients.reduce_gradients`` sums."""
        if self.is_first == self.is_last:
            return None
        return self.output_embedding()

    def forward(
        self,
        tokens: torch.Tensor | None,
        labels: torch.Tensor | None = None,
        chunk: int = 0,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens (b, T) -> per-token loss (b, T) if labels are given on the last (virtual) stage,
        logits (b, T, V) without labels, hidden states (b, T, H) on other stages and chunks (T: this
        rank's T / cp tokens with context parallelism; T / tp outside the GEMMs with SP). With a
        ``cache`` (generation, one whole model: ``distlab.gpt.inference.kv_cache``) the tokens sit
        at positions ``cache.length`` on, and every block appends its keys and values to it."""
        if self.is_first and chunk == 0:
            h = self.wte(tokens)  # (b, T, H), or this rank's (b, T/tp, H) with SP
            if self.ring is not None:  # CP: this rank's two chunks of the sequence
                pos = positions(tokens.shape[1], self.ring, tokens.device)
            else:
                first = self.sp_rank * h.shape[1]  # SP: my positions start at tp_rank x T/tp
                first += cache.length if cache is not None else 0  # after the cached tokens
                pos = torch.arange(first, first + h.shape[1], device=tokens.device)
            # SP: this rank's T/tp positions, from the model-parallel stream (Megatron drops out
            # after the scatter); else (b, T, H), alike on the tp ranks, from the default stream
            sharded = self.cfg.sequence_parallel and self.cfg.hidden_dropout > 0 and self.training
            with fork_if(sharded):
                h = self.drop(h + self.wpe(pos))  # (b, T, H) or (b, T/tp, H)
        else:
            h = self.input_tensor
        blocks = list(self.layers.values())[chunk * self.per_chunk : (chunk + 1) * self.per_chunk]
        for first, end, checkpointed in self.groups:  # full recomputation: keep each group's input only
            if checkpointed and self.training:
                h = checkpoint(_run_blocks, blocks[first:end], h)  # replays both random streams
            else:
                h = _run_blocks(blocks[first:end], h, cache)
        if not (self.is_last and chunk == self.chunks - 1):
            return h
        logits = parallel_lm_logits(  # (b, T, V/tp): all-gathered along T first with SP
            self.ln_f(h), self.output_embedding(), self.tp_group, self.cfg.sequence_parallel
        )
        if labels is None:
            return gather_from_tensor_parallel(logits, self.tp_group)  # (b, T, V)
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group)  # (b, T), fp32


def _run_blocks(blocks: list[Block], h: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    for block in blocks:
        h = block(h, cache.layer(block) if cache is not None else None)  # (b, T, H)
    return h


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + M) V for the last T of P + T positions: q (b, n, T, d), k and v
    (b, n, P + T, d) -> (b, n, T, d); query i sees keys 0 .. P + i (M: -inf elsewhere)."""
    T, S = q.shape[-2], k.shape[-2]
    sees = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # (T, P + T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sees)


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: GPTConfig, state: ParallelState | None) -> None:
    """Layout-independent init: the unsharded tensor from (seed, global name), then this rank's shard.

    LayerNorm weights 1, biases 0; ``proj``/``fc2`` weights N(0, std / sqrt(2L)); the rest N(0, std).
    """
    tp, tp_rank = (state.tp, state.tp_rank) if state is not None else (1, 0)
    for name, p in model.named_parameters():
        key = getattr(p, "init_name", name)
        leaf = key.rsplit(".", 2)
        if key.endswith(".bias"):
            p.zero_()
            continue
        if leaf[-2].startswith("ln"):
            p.fill_(1.0)
            continue
        std = cfg.init_method_std
        if leaf[-2] in ("proj", "fc2"):
            std = std / math.sqrt(2.0 * cfg.num_layers)
        dim = getattr(p, "partition_dim", None)
        full = list(p.shape)
        if dim is not None:
            full[dim] *= tp
        w = torch.randn(full, generator=_generator(cfg.seed, key)) * std
        if dim is not None:
            w = shard(w, dim, tp, tp_rank, getattr(p, "partition_stride", 1))
        p.copy_(w.to(p.dtype))
