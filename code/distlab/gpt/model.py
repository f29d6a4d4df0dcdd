"""GPT for one pipeline stage: pre-LayerNorm blocks, learned positions, tied embeddings.

For tokens ``x`` (B, s) and L blocks::

    h_0     = E[x] + P[0:s]                                   E: (V_pad, h), P: (s_max, h)
    a_l     = h_{l-1} + proj(attn(qkv(LN1(h_{l-1}))))         causal, heads of size h/n
    h_l     = a_l + fc2(gelu(fc1(LN2(a_l))))                  fc1: h -> f, fc2: f -> h
    logits  = LNf(h_L) E^T                                    (B, s, V_pad), tied with E
    loss    = cross_entropy(logits, labels)                   per token, (B, s)

Tensor and pipeline parallelism (``tensor_parallel.py``, ``pipeline_parallel.py``):

- a stage holds the embedding only if ``state.is_first_stage``, blocks
  ``[pp_rank * L/pp, (pp_rank + 1) * L/pp)`` (keyed by their *global* index), and the final
  LayerNorm + output head only if ``state.is_last_stage``; a last stage that is not also the first
  holds its own copy of ``E`` (``output_weight``), initialised identically, whose gradient the
  pipeline sums with the first stage's (``pp_communications.allreduce_tied_embedding_grad``);
- ``qkv``/``fc1`` are column-parallel, ``proj``/``fc2`` row-parallel when tp > 1, built by
  ``column_linear`` / ``row_linear``; the qkv output features are ordered
  ``(head, {q,k,v}, head_dim)``, so a contiguous slice of rows is a set of whole heads, and
  ``heads_per_partition = n // tp``; E is vocabulary-parallel (V_pad / tp rows per rank) and the
  loss is the vocabulary-parallel cross-entropy of the (B, s, V_pad / tp) logit slices;
- initialisation is a function of ``--seed`` and the parameter's *global* name only: the
  full-size tensor is drawn from a generator seeded by (seed, name), then sliced along
  ``param.partition_dim`` (if set) at ``tp_rank``. Every layout starts from the same weights.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_lm_logits,
    vocab_parallel_cross_entropy,
)
from distlab.gpt.tp_communications import gather_from_tensor_parallel


@dataclass
class GPTConfig:
    """Model shape and initialisation (arithmetic: params ~ 12 L h^2 + V_pad h + s_max h)."""

    num_layers: int
    """L, transformer blocks in the whole model (all stages)."""
    hidden_size: int
    """h, the residual stream width."""
    num_attention_heads: int
    """n, heads per block; head size is h / n."""
    vocab_size: int
    """V_pad, the padded vocabulary (a multiple of make-vocab-size-divisible-by x tp)."""
    max_position_embeddings: int
    """s_max, learned positions."""
    ffn_hidden_size: int | None = None
    """f, MLP width; 4h when None."""
    init_method_std: float = 0.02
    """std of the normal init; proj and fc2 use std / sqrt(2L) (GPT-2 / Megatron)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    recompute_activations: bool = False
    """Recompute every block in backward instead of storing its activations."""
    seed: int = 1234
    layernorm_epsilon: float = 1e-5

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


def column_linear(in_features: int, out_features: int, state: ParallelState | None) -> nn.Linear:
    """Y = XA + b with A's columns split over tp ranks (ColumnParallelLinear when tp > 1)."""
    if state is not None and state.tp > 1:
        return ColumnParallelLinear(in_features, out_features, group=state.tp_group)
    return nn.Linear(in_features, out_features)


def row_linear(in_features: int, out_features: int, state: ParallelState | None) -> nn.Linear:
    """Y = XA + b with A's rows split over tp ranks (RowParallelLinear when tp > 1)."""
    if state is not None and state.tp > 1:
        return RowParallelLinear(in_features, out_features, group=state.tp_group)
    return nn.Linear(in_features, out_features)


class SelfAttention(nn.Module):
    """Causal multi-head attention through ``scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig, state: ParallelState | None) -> None:
        super().__init__()
        tp = state.tp if state is not None else 1
        self.heads_per_partition = cfg.num_attention_heads // tp
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.dropout = cfg.attention_dropout
        self.qkv = column_linear(cfg.hidden_size, 3 * cfg.hidden_size, state)
        self.proj = row_linear(cfg.hidden_size, cfg.hidden_size, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # x: (B, T, h)
        qkv = self.qkv(x).view(B, T, self.heads_per_partition, 3, self.head_dim)  # (B, T, nh, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, nh, T, hd)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(B, T, self.heads_per_partition * self.head_dim)  # (B, T, h/tp)
        return self.proj(y)  # (B, T, h)


class MLP(nn.Module):
    """h -> f -> GELU -> h."""

    def __init__(self, cfg: GPTConfig, state: ParallelState | None) -> None:
        super().__init__()
        self.fc1 = column_linear(cfg.hidden_size, cfg.ffn, state)
        self.fc2 = row_linear(cfg.ffn, cfg.hidden_size, state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (B, T, f/tp) inside, (B, T, h) out


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig, state: ParallelState | None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attn = SelfAttention(cfg, state)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg, state)
        self.drop = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPTModel(nn.Module):
    """The part of the GPT that lives on this rank's pipeline stage (all of it when pp = 1)."""

    def __init__(self, cfg: GPTConfig, state: ParallelState | None = None) -> None:
        super().__init__()
        self.cfg, self.state = cfg, state
        tp, pp = (state.tp, state.pp) if state is not None else (1, 1)
        pp_rank = state.pp_rank if state is not None else 0
        self.is_first = state.is_first_stage if state is not None else True
        self.is_last = state.is_last_stage if state is not None else True
        self.tp_group = state.tp_group if tp > 1 else None  # vocab-parallel E, logits and loss
        if self.is_first:
            if tp > 1:  # E: (V_pad / tp, h), rows split over tp ranks
                self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group=self.tp_group)
            else:
                self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # E: (V_pad, h)
            self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)  # P: (s_max, h)
            self.drop = nn.Dropout(cfg.hidden_dropout)
        per_stage = cfg.num_layers // pp
        first_layer = pp_rank * per_stage
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, state) for i in range(first_layer, first_layer + per_stage)}
        )
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
            if not self.is_first:  # own copy of E, kept equal to the first stage's by part 2
                self.output_weight = nn.Parameter(torch.empty(cfg.vocab_size // tp, cfg.hidden_size))
                if tp > 1:
                    self.output_weight.partition_dim = 0  # this rank's vocabulary rows, as wte
                self.output_weight.init_name = "wte.weight"
                self.output_weight.shared_embedding = True
        self.input_tensor: torch.Tensor | None = None  # hidden states from the previous stage
        init_parameters(self, cfg, state)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states (B, T, h) this stage starts from when it is not the first."""
        self.input_tensor = tensor

    def output_embedding(self) -> torch.Tensor:
        return self.wte.weight if self.is_first else self.output_weight

    def forward(self, tokens: torch.Tensor | None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> per-token loss (B, T) if labels are given on the last stage, logits
        (B, T, V_pad) without labels, hidden states (B, T, h) on other stages."""
        if self.is_first:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.drop(self.wte(tokens) + self.wpe(pos))  # (B, T, h)
        else:
            h = self.input_tensor
        for block in self.layers.values():
            if self.cfg.recompute_activations and self.training:
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        if not self.is_last:
            return h
        if self.tp_group is not None:  # logits split by vocabulary: (B, T, V_pad / tp)
            logits = parallel_lm_logits(self.ln_f(h), self.output_embedding(), self.tp_group)
            if labels is None:
                return gather_from_tensor_parallel(logits, self.tp_group)  # (B, T, V_pad)
            return vocab_parallel_cross_entropy(logits, labels, self.tp_group)  # (B, T)
        logits = F.linear(self.ln_f(h), self.output_embedding())  # (B, T, V_pad)
        if labels is None:
            return logits
        return lm_loss(logits, labels)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy in fp32: (B, T, V) x (B, T) -> (B, T)."""
    B, T, V = logits.shape
    return F.cross_entropy(logits.float().view(B * T, V), labels.view(B * T), reduction="none").view(B, T)


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: GPTConfig, state: ParallelState | None) -> None:
    """Layout-independent init: full tensor from (seed, global name), sliced along partition_dim.

    LayerNorm weights 1, biases 0; ``proj``/``fc2`` weights N(0, std/sqrt(2L)); the rest N(0, std).
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


def shard(full: torch.Tensor, dim: int, tp: int, tp_rank: int, stride: int = 1) -> torch.Tensor:
    """Rank ``tp_rank``'s part of ``full`` along ``dim``: ``stride`` blocks, each cut in ``tp``."""
    blocks = full.unflatten(dim, (stride, full.shape[dim] // stride))  # (..., stride, n/stride, ...)
    return blocks.chunk(tp, dim=dim + 1)[tp_rank].flatten(dim, dim + 1)  # (..., n/tp, ...)
