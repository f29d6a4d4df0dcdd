"""GPT for one pipeline stage (Megatron Core's ``models/gpt/gpt_model.py``): the embedding, pre-norm
blocks (``transformer_layer.py``) and the output layer; GPT-2's or Llama's (``transformer/config.py``).

For tokens ``x`` (b, T) (one micro-batch) and L blocks (notation: ``distlab.gpt``'s legend)::

    h_0     = E[x] + P[0:T]                                   E: (V, H), P: (T_max, H) (learned only)
    a_l     = h_{l-1} + proj(attn(qkv(N1(h_{l-1}))))          causal; RoPE rotates q and k
    h_l     = a_l + mlp(N2(a_l))                              fc2(gelu(fc1 .)) or SwiGLU
    logits  = Nf(h_L) W^T                                     (b, T, V); W = E tied, or output_layer
    loss    = cross_entropy(logits, labels)                   per token, (b, T)

N is LayerNorm or RMSNorm (``norms.py``), attention is grouped-query (``attention.py``: n query
heads, g K/V heads of d channels), the MLP GeLU or SwiGLU (``mlp.py``), positions learned, rotary
(``rope.py``, at the tokens' global positions, computed once per stage and passed to every block)
or none.

Tensor parallelism (``tensor_parallel/layers.py``): ``qkv`` and ``fc1`` are column-parallel, ``proj``
and ``fc2`` row-parallel, E (and an untied output layer) is vocabulary-parallel and the loss is the
vocabulary-parallel cross-entropy of the (b, T, V / tp) logit slices. With tp = 1 these are the
same layers with no group: one code path for every layout. Sequence parallelism
(``--sequence-parallel``) keeps the residual stream, the norms and dropout on this rank's T / tp
positions, (b, T / tp, H), split along dim 1 from the embedding's reduce-scatter to the output
layer's all-gather; only attention and the MLP's activation see the whole sequence (on their
H / tp slice). The qkv output features are ordered ``(group, [n/g q, k, v], d)``, so a contiguous
slice of rows is a set of whole groups.

Pipeline parallelism (``pipeline_parallel/schedules.py``): a stage holds the embedding only if it is the
first, blocks ``[pp_rank L / pp, (pp_rank + 1) L / pp)`` (keyed by their *global* index), and
the final LayerNorm + output head only if it is the last. Interleaved (``v = state.vp > 1``
chunks per rank): chunk ``c`` holds the ``L / (pp v)`` blocks of virtual stage ``c pp + pp_rank``,
``forward(..., chunk=c)`` runs them, the embedding before chunk 0 of the first stage, the head
after chunk ``v - 1`` of the last; all chunks are one module, so the optimizer, the gradient
reduction and the checkpoints see every chunk's parameters, by their global names.
A last stage that is not also the first holds its own copy of E (``output_weight``); the
initialiser makes it equal to the first stage's E (same name, same seed), and ``distributed/gradients.py``
sums the two gradients, so they stay equal. Untied (``--untie-embeddings-and-output-weights``), the
last stage's ``output_layer`` is a weight of its own, drawn from its own name, and nothing is summed.

Mixture of experts (``transformer/moe/moe_layer.py``, ``transformer/moe/expert_parallel.py``; ``GPTConfig.moe``): every block's MLP
becomes a router and E experts, split over the ep ranks of the layout's expert groups (and over
tp, etp = tp); each layer attaches its ``coeff l_aux`` to its output for backward (the returned
values stay the lm loss).

Generation (``inference/kv_cache.py``): with a ``cache`` each block's attention appends its new
keys and values (its g K/V heads) and attends to all of them; positions start after the cached ones.

Context parallelism (``context_parallel/ring_attention.py``): with cp > 1 each rank holds T / cp tokens of
every sample (two of 2 cp chunks, their global positions from ``context_parallel.positions``)
and the core attention is :func:`~distlab.gpt.context_parallel.ring_attention.ring_attention` over the cp group;
every other layer is per token and needs nothing. With sequence parallelism as well (Megatron's
Llama 3 script), T is the cp rank's T / cp tokens: the residual stream holds its (b, T / (cp tp), H)
slice, qkv's all-gather over tp restores the cp rank's T / cp for ring attention, and RoPE rotates
them by their global positions (computed for the T / cp before the split over tp).

Precision: under --bf16 / --fp16 the residual stream (h_0, every a_l and h_l, what a stage
receives and sends) is in the training dtype, or in fp32 with ``--fp32-residual-connection``
(:meth:`GPTModel.residual_dtype`, Megatron's ``fp32_residual_connection``); the norms return the
compute dtype (``norms.py``), the loss is fp32.

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

import dataclasses
import math
import zlib
from typing import TYPE_CHECKING

import torch
from torch import nn

from distlab.gpt.context_parallel.ring_attention import positions, ring_of
from distlab.gpt.layout import Layout
from distlab.gpt.model_layout import ModelShape, check_model_layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from distlab.gpt.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    parallel_lm_logits,
    shard,
)
from distlab.gpt.tensor_parallel.mappings import gather_from_tensor_parallel
from distlab.gpt.tensor_parallel.rng_tracker import checkpoint, fork_if
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.norms import compute_dtype
from distlab.gpt.transformer.recompute import checkpoint_groups, recompute_errors
from distlab.gpt.transformer.rope import rotary_angles
from distlab.gpt.transformer.transformer_layer import Block, build_norm

if TYPE_CHECKING:  # the cache lives in inference/, above this layer: the model only calls it
    from distlab.gpt.inference.kv_cache import KVCache


class GPTModel(nn.Module):
    """The part of the GPT that lives on this rank's pipeline stage (all of it when pp = 1)."""

    #: Its forward reads the untied output layer's weight itself (``parallel_lm_logits``): the
    #: distributed optimizer's --overlap-param-gather waits for its bucket in this module's hook.
    reads_parameters_of = ("output_layer",)

    def __init__(self, cfg: GPTConfig, state: ParallelState | None = None) -> None:
        super().__init__()
        self.cfg, self.state = cfg, state
        tp, pp, vp = (state.tp, state.pp, state.vp) if state is not None else (1, 1, 1)
        pp_rank = state.pp_rank if state is not None else 0
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp - 1
        self.tp_group = state.tp_group if tp > 1 else None  # None: every operator is the identity
        self.ring = ring_of(state)
        layout = state.layout if state is not None else Layout(1)
        if cfg.sequence_parallel != layout.sequence_parallel:  # raises without tp
            layout = dataclasses.replace(layout, sequence_parallel=cfg.sequence_parallel)
        check_model_layout(ModelShape.of(cfg), layout)  # validate_args checks it before a run
        sp = cfg.sequence_parallel
        self.sp_size, self.sp_rank = (tp, state.tp_rank) if sp else (1, 0)  # which T/tp positions are here
        self.learned = cfg.position_embedding_type == "learned_absolute"
        self.rotary_dim = (
            int(cfg.head_dim * cfg.rotary_percent) if cfg.position_embedding_type == "rope" else 0
        )
        if self.is_first:
            self.wte = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, group=self.tp_group, sequence_parallel=sp
            )
            if self.learned:
                self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)  # P: (T_max, H)
                if sp:
                    mark_sequence_parallel(
                        self.wpe.weight
                    )  # rank r adds (and differentiates) rows of its T/tp
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
            self.ln_f = build_norm(cfg)
            if cfg.untie_embeddings_and_output_weights:  # its own (V / tp, H), vocabulary-parallel
                self.output_layer = ColumnParallelLinear(
                    cfg.hidden_size, cfg.vocab_size, group=self.tp_group, bias=False, sequence_parallel=sp
                )
            elif not self.is_first:  # own copy of E: (V / tp, H), rows split as the first stage's
                self.output_weight = nn.Parameter(torch.empty(cfg.vocab_size // tp, cfg.hidden_size))
                self.output_weight.partition_dim = 0
                self.output_weight.init_name = "wte.weight"  # drawn as E: equal from the start
                self.output_weight.shared_embedding = True  # counted once by the gradient norm
            if sp:
                for p in self.ln_f.parameters():
                    mark_sequence_parallel(p)
        self.input_tensor: torch.Tensor | None = None  # hidden states from the previous stage
        init_parameters(self, cfg, state)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Hidden states (b, T, H), (b, T/tp, H) with SP, this stage starts from when it is not the first."""
        self.input_tensor = tensor

    def output_embedding(self) -> torch.Tensor:
        """The output layer's (V / tp, H) weight: its own when untied, else E (this stage's own
        copy of it when the stage is not the first)."""
        if self.cfg.untie_embeddings_and_output_weights:
            return self.output_layer.weight
        return self.wte.weight if self.is_first else self.output_weight

    def tied_embedding(self) -> torch.Tensor | None:
        """E on the last stage when it is tied and the first and last are different stages, else
        None: the weight whose two gradients ``gradients.reduce_gradients`` sums."""
        if self.is_first == self.is_last or self.cfg.untie_embeddings_and_output_weights:
            return None
        return self.output_embedding()

    def residual_dtype(self, h: torch.Tensor) -> torch.dtype:
        """The residual stream's dtype for ``h``, the embeddings' output or a received stage input:
        fp32 with ``--fp32-residual-connection``, else the compute dtype (autocast's, or ``h``'s own
        without autocast: the weights')."""
        if self.cfg.fp32_residual_connection:
            return torch.float32
        return compute_dtype(h.device.type, h.dtype)

    def positions(self, length: int, device: torch.device, first: int = 0) -> torch.Tensor:
        """Global positions (length,) of the ``length`` tokens of each sample attention sees on this
        rank: its two chunks' with context parallelism, else first .. first + length - 1 (``first``:
        the tokens already in a KV cache)."""
        if self.ring is not None:
            return positions(length, self.ring, device)
        return torch.arange(first, first + length, device=device)

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
        cached = cache.length if cache is not None else 0
        if self.is_first and chunk == 0:
            pos = self.positions(tokens.shape[1], tokens.device, cached)  # (T,), global
            h = self.wte(tokens)  # (b, T, H), or this rank's (b, T/tp, H) with SP
            if self.learned:
                h = h + self.wpe(pos.chunk(self.sp_size)[self.sp_rank])  # SP: my T/tp positions' rows
            h = h.to(self.residual_dtype(h))  # the residual stream's dtype from here on
            # SP: this rank's T/tp positions, from the model-parallel stream (Megatron drops out
            # after the scatter); else (b, T, H), alike on the tp ranks, from the default stream
            sharded = self.cfg.sequence_parallel and self.cfg.hidden_dropout > 0 and self.training
            with fork_if(sharded):
                h = self.drop(h)  # (b, T, H) or (b, T/tp, H)
        else:
            h = self.input_tensor.to(self.residual_dtype(self.input_tensor))  # as the stages exchange it
            pos = self.positions(h.shape[1] * self.sp_size, h.device, cached) if self.rotary_dim else None
        scaling = self.cfg.rope_scaling_factor if self.cfg.rope_scaling else None
        rotary = (
            rotary_angles(pos, self.rotary_dim, self.cfg.rotary_base, scaling) if self.rotary_dim else None
        )
        blocks = list(self.layers.values())[chunk * self.per_chunk : (chunk + 1) * self.per_chunk]
        for first, end, checkpointed in self.groups:  # full recomputation: keep each group's input only
            if checkpointed and self.training:
                h = checkpoint(_run_blocks, blocks[first:end], h, rotary)  # replays both random streams
            else:
                h = _run_blocks(blocks[first:end], h, rotary, cache)
        if not (self.is_last and chunk == self.chunks - 1):
            return h
        logits = parallel_lm_logits(  # (b, T, V/tp): all-gathered along T first with SP
            self.ln_f(h), self.output_embedding(), self.tp_group, self.cfg.sequence_parallel
        )
        if labels is None:
            return gather_from_tensor_parallel(logits, self.tp_group)  # (b, T, V)
        return vocab_parallel_cross_entropy(logits, labels, self.tp_group)  # (b, T), fp32


def _run_blocks(
    blocks: list[Block], h: torch.Tensor, rotary: torch.Tensor | None, cache: KVCache | None = None
) -> torch.Tensor:
    for block in blocks:  # keywords: DTensor's input plans see h alone
        h = block(h, rotary=rotary, cache=cache.layer(block) if cache is not None else None)  # (b, T, H)
    return h


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: GPTConfig, state: ParallelState | None) -> None:
    """Layout-independent init: the unsharded tensor from (seed, global name), then this rank's shard.

    Norm weights 1 (0 with ``--apply-layernorm-1p``), biases 0; ``proj``/``fc2`` weights
    N(0, std / sqrt(2L)); the rest N(0, std), the untied ``output_layer`` included (Megatron's
    ``init_method``).
    """
    tp, tp_rank = (state.tp, state.tp_rank) if state is not None else (1, 0)
    for name, p in model.named_parameters():
        if p.is_meta:  # a dry run's model (planning/dry_run.py): shapes only, nothing to draw
            continue
        key = getattr(p, "init_name", name)
        leaf = key.rsplit(".", 2)
        if key.endswith(".bias"):
            p.zero_()
            continue
        if leaf[-2].startswith("ln"):
            p.fill_(model.get_submodule(name.rsplit(".", 1)[0]).init_value)
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
