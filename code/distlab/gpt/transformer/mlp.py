"""The dense MLP: GeLU (GPT-2) or SwiGLU (Llama, ``--swiglu``), tensor-parallel (megatron-core's MLP).

For x (b, T, H) and width F::

    GeLU     y = gelu(x A) C                    A: (H, F)            C: (F, H)
    SwiGLU   y = (silu(x A_gate) * (x A_up)) C  A = [A_gate, A_up]: (H, 2F)

(Shazeer 2020, "GLU Variants Improve Transformer"; silu(z) = z sigmoid(z).) SwiGLU has three
F x H matrices where GeLU has two, which is why Megatron's default F for it is 2/3 of 4H
(rounded down to a multiple of 64: ``validate_args``). ``--openai-gelu`` computes GeLU as
0.5 z (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3))) (megatron-core's ``openai_gelu``, GPT-2's
``gelu_new``; ``F.gelu(approximate="tanh")``) instead of the exact z Phi(z).

**Tensor parallelism.** ``fc1`` is column-parallel and ``fc2`` row-parallel, as for GeLU. With
SwiGLU, fc1's weight is the (2F, H) ``[A_gate; A_up]`` (rows are output features) split with
stride 2 (``tensor_parallel.shard``): rank r holds ``[A_gate,r; A_up,r]``, the r-th F / tp of
each, so its output chunks into its own gate and up slices and the product is computed where
they are, with no communication between fc1 and fc2 (megatron-core's ``linear_fc1`` with
``gated_linear_unit``, whose per-rank output is chunked in two the same way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab.gpt.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from distlab.gpt.transformer.config import GPTConfig


class MLP(nn.Module):
    """H -> F -> H, GeLU or SwiGLU, with F split over the tp ranks."""

    def __init__(self, cfg: GPTConfig, group) -> None:
        super().__init__()
        sp, bias, self.swiglu = cfg.sequence_parallel, cfg.add_bias_linear, cfg.swiglu
        self.gelu = "tanh" if cfg.openai_gelu else "none"  # --openai-gelu: GPT-2's gelu_new
        width = 2 * cfg.ffn if cfg.swiglu else cfg.ffn  # [gate; up] with SwiGLU
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            width,
            group=group,
            bias=bias,
            sequence_parallel=sp,
            stride=2 if cfg.swiglu else 1,
        )
        self.fc2 = RowParallelLinear(cfg.ffn, cfg.hidden_size, group=group, bias=bias, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (b, T, H), or (b, T/tp, H) with SP
        y = self.fc1(x)  # f (or all-gather), then (b, T, F/tp), or [gate_r, up_r] (b, T, 2F/tp)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)  # (b, T, F/tp) each: this rank's slices of both
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu)
        return self.fc2(y)  # partial (b, T, H) per rank, then g (all-reduce) or g-bar (reduce-scatter)
