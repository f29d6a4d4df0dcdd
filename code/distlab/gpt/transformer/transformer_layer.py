"""One transformer layer, pre-norm (Megatron Core's ``transformer/transformer_layer.py``); the
model that stacks them is ``gpt_model.py``.

For a hidden state ``h`` (b, T, H) (T / tp with sequence parallelism)::

    a = h + proj(attn(qkv(N1(h))))          causal; RoPE rotates q and k
    h' = a + mlp(N2(a))                     fc2(gelu(fc1 .)) or SwiGLU; a router and experts with MoE

The residual stream h, a, h' keeps the dtype of the block's input (the training dtype, or fp32
with ``--fp32-residual-connection``: ``gpt_model.GPTModel.residual_dtype``); each branch's output
(the compute dtype, fp32 after an fp32 bias) is cast to it before the sum, as Megatron's
bias-dropout-add casts to the residual's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from distlab.gpt.context_parallel.ring_attention import Ring
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tensor_parallel.layers import mark_sequence_parallel
from distlab.gpt.tensor_parallel.rng_tracker import fork_if
from distlab.gpt.transformer.attention import SelfAttention
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.mlp import MLP
from distlab.gpt.transformer.moe.moe_layer import MoELayer
from distlab.gpt.transformer.norms import Norm

if TYPE_CHECKING:  # the cache lives in inference/, above this layer: the block only calls it
    from distlab.gpt.inference.kv_cache import LayerCache


class Block(nn.Module):
    """Pre-norm transformer block: per direction, one f and one g around attention and
    around the MLP, so 2 all-reduces forward and 2 backward when tp > 1. With sequence
    parallelism: 2 all-gathers and 2 reduce-scatters forward; backward 2 reduce-scatters and
    4 all-gathers (2 of them gather the GEMM inputs again for the weight gradients)."""

    def __init__(
        self, cfg: GPTConfig, group, state: ParallelState | None = None, ring: Ring | None = None
    ) -> None:
        super().__init__()
        self.ln1 = build_norm(cfg)
        self.attn = SelfAttention(cfg, group, ring)
        self.ln2 = build_norm(cfg)
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

    def forward(
        self, x: torch.Tensor, *, rotary: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """(b, T, H) -> (b, T, H) in x's dtype, T/tp with SP; ``rotary``: RoPE's (T, d_rot) angles
        or None; ``cache``: this block's keys and values so far (generation)."""
        with fork_if(self.sequence_parallel and self.dropout and self.training):
            x = x + self.drop(self.attn(self.ln1(x), rotary=rotary, cache=cache)).to(x.dtype)
            return x + self.drop(self.mlp(self.ln2(x))).to(x.dtype)


def build_norm(cfg: GPTConfig) -> Norm:
    """The block's (and the final) norm: LayerNorm or RMSNorm as ``cfg`` says."""
    return Norm(cfg.hidden_size, cfg.normalization, cfg.layernorm_epsilon, cfg.layernorm_zero_centered_gamma)
