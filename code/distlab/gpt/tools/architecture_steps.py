"""GPT-2 -> Llama, one change at a time (notebook 11): each change's parameters, FLOPs and K/V
cache per token, measured on the engine's own model.

    GPT-2 -> + RMSNorm -> + RoPE -> + SwiGLU (F) -> + GQA (g K/V heads) -> + untied output -> + no biases

Each step is the one before plus one change (``GPTConfig`` fields, Megatron's flags in
``transformer/config.py``). Parameters: the model built on PyTorch's meta device (shapes only,
nothing allocated), summed. FLOPs per token of one forward and backward at ``S`` tokens:
``torch.utils.flop_counter.FlopCounterMode`` over the meta model (``training.flops.counted_flops``)
for 1 and 2 blocks; the blocks are identical, so L blocks cost f(1) + (L - 1)(f(2) - f(1)), exactly.
K/V cache per token at generation: the engine's ``KVCache`` after one token of a one-block model
1/``scale`` as wide (n / scale query heads and g / scale K/V heads of the same d), times ``scale``
and L, at 2 bytes a value (bf16): 2 L g d x 2 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlab.gpt.inference.kv_cache import KVCache
from distlab.gpt.training.flops import counted_flops
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel

#: Llama 3 8B's widths (Llama 3 paper, 2024, Table 3; the released vocabulary of 128,256) and a
#: sequence of 8,192 tokens: L, H, n query heads, V, S.
LLAMA3_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=128256, seq_length=8192)

#: (name, the change) from GPT-2 to Llama 3 8B.
STEPS = (
    ("GPT-2", {}),
    ("+ RMSNorm", {"normalization": "RMSNorm"}),
    ("+ RoPE", {"position_embedding_type": "rope", "rotary_base": 500000}),
    ("+ SwiGLU, F = 3.5H", {"swiglu": True, "ffn_hidden_size": 14336}),
    ("+ GQA, 8 K/V heads", {"num_query_groups": 8}),
    ("+ untied output", {"untie_embeddings_and_output_weights": True}),
    ("+ no biases", {"add_bias_linear": False}),
)


@dataclass
class Step:
    name: str
    parameters: int
    flops_per_token: float  # forward + backward
    kv_bytes_per_token: int  # bf16


def _config(shape: dict, arch: dict, num_layers: int | None = None) -> GPTConfig:
    L, H, n, V, S = (
        shape[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length")
    )
    return GPTConfig(num_layers or L, H, n, V, S, **arch)


def parameters(shape: dict, arch: dict) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPTModel(_config(shape, arch)).parameters())


def flops_per_token(shape: dict, arch: dict) -> float:
    f1, f2 = (counted_flops(**{**shape, "num_layers": n}, batch=1, **arch) for n in (1, 2))
    return (f1 + (shape["num_layers"] - 1) * (f2 - f1)) / shape["seq_length"]


def kv_bytes_per_token(shape: dict, arch: dict, scale: int = 8) -> int:
    H, n = shape["hidden_size"], shape["num_attention_heads"]
    g = arch.get("num_query_groups", n) // scale
    small = GPTConfig(
        1, H // scale, n // scale, 64, 8, **{**arch, "num_query_groups": g, "ffn_hidden_size": 64}
    )
    cache = KVCache(1)  # room for one token
    with torch.no_grad():
        GPTModel(small).eval()(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    return cache.nbytes() * scale * shape["num_layers"] // 2  # fp32 values -> bf16


def measure(shape: dict = LLAMA3_8B, steps=STEPS) -> list[Step]:
    """Every step's parameters, FLOPs per token and K/V cache per token (see the module's docstring)."""
    rows, arch = [], {}
    for name, change in steps:
        arch = arch | change
        rows.append(
            Step(name, parameters(shape, arch), flops_per_token(shape, arch), kv_bytes_per_token(shape, arch))
        )
    return rows
