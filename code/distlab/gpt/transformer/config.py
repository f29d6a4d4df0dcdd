"""The model's shape: GPT-2's architecture by default, Llama's with Megatron's switches.

Each field is a field of megatron-core's ``TransformerConfig`` (or of Megatron-LM's arguments,
for the embeddings) of the same name and default, except ``swiglu`` (Megatron's ``--swiglu``, which
sets ``gated_linear_unit`` and ``activation_func=F.silu``)::

    GPT-2 (the defaults)                        Llama (Megatron's examples/llama scripts)
    normalization LayerNorm, with biases        RMSNorm (--normalization RMSNorm), no bias
    learned positions P[0:T] added to E[x]      RoPE on q and k (--position-embedding-type rope)
    MLP  fc2(gelu(fc1 x)), F = 4H               fc2(silu(x W_gate) * (x W_up)) (--swiglu)
    n heads of K and V (multi-head)             g groups of n/g query heads share one K/V head
                                                (--group-query-attention --num-query-groups g)
    biases on every linear layer                none (--disable-bias-linear)
    output layer = E (tied)                     its own weight (--untie-embeddings-and-output-weights)

Arithmetic, d = kv_channels (H / n by default), per block: attention ``H (n + 2g) d + n d H``
weights, the MLP ``2 H F`` (GeLU) or ``3 H F`` (SwiGLU).
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.gpt.transformer.moe.moe_layer import MoEConfig
from distlab.gpt.transformer.recompute import ATTENTION_BACKENDS

#: ``--normalization``'s and ``--position-embedding-type``'s choices built here.
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")


@dataclass
class GPTConfig:
    """Model shape and initialisation (GPT-2 arithmetic: params ~ 12 L H^2 + V H + T_max H)."""

    num_layers: int
    """L, transformer blocks in the whole model (all stages)."""
    hidden_size: int
    """H, the residual stream width."""
    num_attention_heads: int
    """n, query heads per block, of size ``kv_channels``."""
    vocab_size: int
    """V, the padded vocabulary (a multiple of make-vocab-size-divisible-by x tp)."""
    max_position_embeddings: int
    """T_max, rows of the learned position table (learned_absolute only)."""
    ffn_hidden_size: int | None = None
    """F, MLP width; 4H when None (``validate_args`` applies Megatron's SwiGLU default first)."""
    num_query_groups: int | None = None
    """g, K/V heads (grouped-query attention); None: g = n, multi-head attention."""
    kv_channels: int | None = None
    """d, the size of each head (q, k and v); None: H / n."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm, every norm of the model."""
    layernorm_epsilon: float = 1e-5
    """``--norm-epsilon``, of every LayerNorm / RMSNorm."""
    layernorm_zero_centered_gamma: bool = False
    """``--apply-layernorm-1p``: the norms store gamma - 1 (initialised 0) and scale by 1 + it."""
    add_bias_linear: bool = True
    """False with ``--disable-bias-linear``: no bias on qkv, proj, fc1, fc2."""
    add_qkv_bias: bool = False
    """``--add-qkv-bias``: a bias on qkv even without the others (Qwen2); megatron-core's field."""
    openai_gelu: bool = False
    """``--openai-gelu``: the (non-gated) MLP's GeLU is the tanh approximation (GPT-2's ``gelu_new``)."""
    swiglu: bool = False
    """``--swiglu``: fc1 is two matrices, gate and up, F each; y = silu(gate) * up."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute (a table P), rope (rotations of q and k), none."""
    rotary_base: int = 10000
    """RoPE's base b: pair i of a head rotates by position x b^(-2i / d_rot)."""
    rotary_percent: float = 1.0
    """The fraction of each head's d channels RoPE rotates (d_rot = d x it); the rest pass as they are."""
    rope_scaling: bool = False
    """``--use-rope-scaling``: Llama 3.x's frequencies (``rope.llama3_frequencies``; megatron-core's
    ``GPTModel(rope_scaling=...)``)."""
    rope_scaling_factor: float = 8.0
    """``--rope-scaling-factor``: what the lowest frequencies are divided by."""
    untie_embeddings_and_output_weights: bool = False
    """The output layer on the last stage has its own (V, H) weight instead of E."""
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
    """auto, flash, fused: ``F.scaled_dot_product_attention``; unfused, local: the explicit product."""
    seed: int = 1234
    moe: MoEConfig | None = None
    """None: dense MLPs; else every block's MLP is a mixture of experts."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: activations outside the tp GEMMs split along T (needs tp > 1)."""
    fp32_residual_connection: bool = False
    """``--fp32-residual-connection``: the residual stream (the embeddings' output, every block's
    sums, what the pipeline stages exchange) in fp32 under --bf16 / --fp16; without it, in the
    dtype the layers compute in (``norms.compute_dtype``), as Megatron keeps it in its params dtype."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """g: n without grouped-query attention."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """d: ``kv_channels``, H / n by default."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        errors = architecture_errors(
            self.num_attention_heads, self.num_query_groups, self.normalization, self.position_embedding_type
        )
        if self.attention_backend not in ATTENTION_BACKENDS:
            errors.append(f"attention backend {self.attention_backend!r} must be one of {ATTENTION_BACKENDS}")
        if self.position_embedding_type == "rope":
            errors += rotary_errors(self.head_dim, self.rotary_percent)
        errors += variant_errors(
            self.position_embedding_type, self.rope_scaling, self.openai_gelu, self.swiglu
        )
        if errors:
            raise ValueError("; ".join(errors))


def architecture_errors(
    num_attention_heads: int, num_query_groups: int | None, normalization: str, position_embedding_type: str
) -> list[str]:
    """The choices and the query groups against the heads (each group is n / g whole query heads)."""
    errors = []
    if normalization not in NORMALIZATIONS:
        errors.append(f"--normalization {normalization}: choose one of {', '.join(NORMALIZATIONS)}")
    if position_embedding_type not in POSITION_EMBEDDINGS:
        errors.append(
            f"--position-embedding-type {position_embedding_type}: choose one of {', '.join(POSITION_EMBEDDINGS)}"
        )
    g = num_query_groups
    if g is not None and (g < 1 or num_attention_heads % g):
        errors.append(
            f"--num-query-groups {g} must divide --num-attention-heads {num_attention_heads} (each K/V "
            f"head serves n / g query heads): choose a divisor of {num_attention_heads}"
        )
    return errors


def rotary_errors(head_dim: int, rotary_percent: float) -> list[str]:
    """RoPE rotates pairs (i, i + d_rot / 2) of the first d_rot = d x percent channels: an even d_rot > 0."""
    rotated = int(head_dim * rotary_percent)
    if not 0.0 < rotary_percent <= 1.0 or rotated < 2 or rotated % 2:
        return [
            f"--rotary-percent {rotary_percent} of a head of {head_dim} channels rotates {rotated}: RoPE needs "
            f"an even number of channels >= 2 (0 < percent <= 1); choose e.g. --rotary-percent 1.0"
        ]
    return []


def variant_errors(
    position_embedding_type: str, rope_scaling: bool, openai_gelu: bool, swiglu: bool
) -> list[str]:
    """The switches that change one part of the model, refused where that part is not built
    (Megatron-LM ignores them there)."""
    errors = []
    if rope_scaling and position_embedding_type != "rope":
        errors.append(
            f"--use-rope-scaling with --position-embedding-type {position_embedding_type}: it scales RoPE's "
            f"frequencies; add --position-embedding-type rope or drop it"
        )
    if openai_gelu and swiglu:
        errors.append("--openai-gelu with --swiglu: SwiGLU has no GeLU to approximate; drop one of them")
    return errors
