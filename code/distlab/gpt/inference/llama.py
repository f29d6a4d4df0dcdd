"""The course's Llama <-> transformers' ``LlamaForCausalLM``, weight by weight.

The course's Llama is the run of ``--normalization RMSNorm --position-embedding-type rope --swiglu
--disable-bias-linear`` (``transformer/config.py``), with or without ``--group-query-attention
--num-query-groups g`` and ``--untie-embeddings-and-output-weights``. With n query heads, g K/V
heads of d channels (``--kv-channels``, ``head_dim``), r = n / g, F = ``--ffn-hidden-size``
(``intermediate_size``) and the padded vocabulary V (l is a block; every linear layer is an
``nn.Linear``, weight (out, in), on both sides, and none has a bias)::

    course                                   LlamaForCausalLM (``model.`` before all but lm_head)
    wte.weight                  (V, H)       embed_tokens.weight                         same
    layers.l.ln1.weight         (H,)         layers.l.input_layernorm.weight             same
    layers.l.attn.qkv.weight    ((n+2g)d, H) layers.l.self_attn.{q,k,v}_proj.weight
        rows in (group, [r query heads, k, v], d) order (megatron-core's; a tp slice is whole
        groups): viewed (g, r + 2, d, H), q_proj = [:, :r] (n d, H): query head j in group j // r,
        as transformers' ``repeat_kv`` pairs them; k_proj = [:, r], v_proj = [:, r + 1] (g d, H)
    layers.l.attn.proj.weight   (H, n d)     layers.l.self_attn.o_proj.weight            same
    layers.l.ln2.weight         (H,)         layers.l.post_attention_layernorm.weight    same
    layers.l.mlp.fc1.weight     (2F, H)      layers.l.mlp.gate_proj.weight = rows [:F],
        [W_gate; W_up] (``mlp.py``)          layers.l.mlp.up_proj.weight = rows [F:]     (F, H) each
    layers.l.mlp.fc2.weight     (H, F)       layers.l.mlp.down_proj.weight               same
    ln_f.weight                 (H,)         norm.weight                                 same
    output_layer.weight (untied) (V, H)      lm_head.weight; tied: not written, ``tie_word_embeddings``

**RoPE needs no permutation.** The course rotates each head's channel i with channel i + d / 2
(rotate-half, ``rope.py``, megatron-core's default), and so does transformers' Llama
(``modeling_llama.rotate_half``: ``[-x2, x1]`` of the two halves, cos and sin of the d / 2 angles
repeated twice). Meta's original weights rotate interleaved pairs (2i, 2i + 1); transformers'
``convert_llama_weights_to_hf.py`` permutes their q and k rows into rotate-half order once
(``permute``: each head's rows viewed (d / 2, 2) and transposed), so every transformers folder is
already in the course's order and q, k are copied as they are. (Megatron's ``--rotary-interleaved``
would need that permutation; it is not built here.)

Configuration: ``rms_norm_eps`` is ``--norm-epsilon``; ``rope_parameters.rope_theta`` is
``--rotary-base`` (an integer in Megatron); ``num_key_value_heads`` g; ``head_dim`` d;
``max_position_embeddings`` T_max (the positions generation may use; RoPE has no table);
``hidden_act`` silu. Refused on the way in, each naming the field and what the course lacks: a
bias (``attention_bias``, ``mlp_bias``: q/k/v's alone is Qwen2's, ``qwen2.py``), RoPE scaling other
than Llama 3's (``rope_scaling.py``: ``rope_type`` llama3 is ``--use-rope-scaling``), a partial
rotation (``partial_rotary_factor``), another activation, a non-integral base.

**``--apply-layernorm-1p``** (Megatron's Llama 3 script passes it; megatron-core's
``layernorm_zero_centered_gamma``): each RMSNorm stores gamma - 1 and scales by 1 + it
(``norms.py``). transformers stores gamma itself, so on the way out every norm weight (ln1, ln2,
ln_f) is written as 1 + the stored value, in fp32: the same function. On the way in the course run
gets plain gamma (no ``--apply-layernorm-1p``), so course -> HF -> course is bit-equal for runs without
it and equal in function for runs with it. The Mixtral module (``mixtral.py``) reuses all but the MLP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.inference import rope_scaling
from distlab.gpt.inference.architecture import Architecture, ConversionError, Needs, StateDict, unmet
from distlab.gpt.transformer.config import GPTConfig

#: The flags of the course's Llama (dense or MoE alike; the MLP is each family's).
NEEDS: Needs = {
    "normalization": ("RMSNorm", "--normalization RMSNorm"),
    "position_embedding_type": ("rope", "--position-embedding-type rope"),
    "rotary_percent": (1.0, "--rotary-percent 1.0"),
    "swiglu": (True, "--swiglu"),
    "add_bias_linear": (False, "--disable-bias-linear"),
    "add_qkv_bias": (False, "no --add-qkv-bias"),
}
#: Per block, the weights copied as they are: course suffix -> transformers suffix.
SAME = {
    "ln1.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "ln2.weight": "post_attention_layernorm.weight",
}
MlpMap = Callable[[StateDict, str, str, GPTConfig], StateDict]  # (sd, course prefix, hf prefix, cfg)


def mismatches(args: PretrainArgs) -> list[str]:
    return unmet(args, {"num_experts": (None, "no --num-experts"), **NEEDS})


def standard(config: dict) -> dict:
    """``config.json`` with transformers' own defaults and RoPE fields (``rope_parameters``, from
    the older ``rope_theta`` / ``rope_scaling`` too), as its config class reads it."""
    from transformers import CONFIG_MAPPING

    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    try:
        return CONFIG_MAPPING[config["model_type"]](**fields).to_dict()
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"transformers refuses this config.json: {exc}") from None


def hf_config(cfg: GPTConfig, args: PretrainArgs) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.query_groups,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_parameters": rope_scaling.hf_rope(cfg),
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": args.attention_dropout,
        "initializer_range": args.init_method_std,
    }


def course_args(config: dict) -> dict:
    """The course flags of a Llama (or Mixtral: the same attention, norms and embeddings)."""
    c = standard(config)
    rope = c["rope_parameters"] or {}
    theta = rope.get("rope_theta")
    refused = {
        "hidden_act": (c["hidden_act"], "silu", "SwiGLU's silu (--swiglu)"),
        "attention_bias": (c.get("attention_bias", False), False, "no bias: --disable-bias-linear is all or none"),
        "mlp_bias": (c.get("mlp_bias", False), False, "no bias: --disable-bias-linear is all or none"),
        "rope_parameters.partial_rotary_factor": (rope.get("partial_rotary_factor", 1.0), 1.0,
                                                  "transformers' Llama rotates whole heads"),
        "rope_parameters.rope_theta": (theta, theta and float(int(theta)), "an integer --rotary-base"),
    }  # fmt: skip
    wrong = [
        f"{k} {got!r} (the course computes {what})" for k, (got, ok, what) in refused.items() if got != ok
    ] + rope_scaling.refused(rope)
    if wrong:
        raise ConversionError(
            f"this {config['model_type']} model computes what the course cannot: " + "; ".join(wrong)
        )
    n, g = c["num_attention_heads"], c["num_key_value_heads"]
    return {
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_attention_heads": n,
        "group_query_attention": g != n,
        **({"num_query_groups": g} if g != n else {}),
        "kv_channels": c.get("head_dim") or c["hidden_size"] // n,
        "ffn_hidden_size": c["intermediate_size"],
        "max_position_embeddings": c["max_position_embeddings"],
        "position_embedding_type": "rope",
        "rotary_base": int(theta),
        **rope_scaling.course_args(rope),
        "normalization": "RMSNorm",
        "layernorm_epsilon": c["rms_norm_eps"],
        "swiglu": True,
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not c["tie_word_embeddings"],
        "hidden_dropout": 0.0,
        "attention_dropout": float(c.get("attention_dropout") or 0.0),
        "init_method_std": c["initializer_range"],
    }


def split_qkv(w: torch.Tensor, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv ((n + 2g) d, H), rows (group, [r q, k, v], d) -> q_proj (n d, H), k_proj, v_proj (g d, H)."""
    g, d = cfg.query_groups, cfg.head_dim
    r = cfg.num_attention_heads // g
    w = w.unflatten(0, (g, r + 2, d))  # (g, r + 2, d, H)
    return w[:, :r].flatten(0, 2), w[:, r].flatten(0, 1), w[:, r + 1].flatten(0, 1)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """The inverse of :func:`split_qkv`."""
    g, d = cfg.query_groups, cfg.head_dim
    q = q.unflatten(0, (g, -1, d))  # (g, r, d, H)
    return torch.cat([q, k.unflatten(0, (g, 1, d)), v.unflatten(0, (g, 1, d))], dim=1).flatten(0, 2)


def dense_to_hf(sd: StateDict, c: str, h: str, cfg: GPTConfig) -> StateDict:
    gate, up = sd[f"{c}mlp.fc1.weight"].chunk(2)  # (F, H) each
    return {f"{h}mlp.gate_proj.weight": gate, f"{h}mlp.up_proj.weight": up,
            f"{h}mlp.down_proj.weight": sd[f"{c}mlp.fc2.weight"]}  # fmt: skip


def dense_from_hf(sd: StateDict, c: str, h: str, cfg: GPTConfig) -> StateDict:
    fc1 = torch.cat([sd[f"{h}mlp.gate_proj.weight"], sd[f"{h}mlp.up_proj.weight"]])  # (2F, H)
    return {f"{c}mlp.fc1.weight": fc1, f"{c}mlp.fc2.weight": sd[f"{h}mlp.down_proj.weight"]}


def _gammas(sd: StateDict, cfg: GPTConfig) -> StateDict:
    """Every norm's gamma as transformers stores it: 1 + the stored weight under ``--apply-layernorm-1p``."""
    if not cfg.layernorm_zero_centered_gamma:
        return sd
    norm = ("ln1.weight", "ln2.weight", "ln_f.weight")
    return {k: v.float() + 1 if k.endswith(norm) else v for k, v in sd.items()}


def to_hf(sd: StateDict, cfg: GPTConfig, mlp: MlpMap = dense_to_hf) -> StateDict:
    sd = _gammas(sd, cfg)
    out = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["ln_f.weight"]}
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for i in range(cfg.num_layers):
        c, h = f"layers.{i}.", f"model.layers.{i}."
        out |= {h + hf: sd[c + course] for course, hf in SAME.items()}
        q, k, v = split_qkv(sd[f"{c}attn.qkv.weight"], cfg)
        out |= {f"{h}self_attn.q_proj.weight": q, f"{h}self_attn.k_proj.weight": k,
                f"{h}self_attn.v_proj.weight": v}  # fmt: skip
        out |= mlp(sd, c, h, cfg)
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(sd: StateDict, cfg: GPTConfig, mlp: MlpMap = dense_from_hf) -> StateDict:
    out = {"wte.weight": sd["model.embed_tokens.weight"], "ln_f.weight": sd["model.norm.weight"]}
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        c, h = f"layers.{i}.", f"model.layers.{i}."
        out |= {c + course: sd[h + hf] for course, hf in SAME.items()}
        q, k, v = (sd[f"{h}self_attn.{p}_proj.weight"] for p in "qkv")
        out[f"{c}attn.qkv.weight"] = fuse_qkv(q, k, v, cfg)
        out |= mlp(sd, c, h, cfg)
    return {k: v.contiguous() for k, v in out.items()}


def read_name(name: str) -> str | None:
    """Older transformers saved RoPE's ``rotary_emb.inv_freq`` buffers: no weight."""
    return None if name.endswith("rotary_emb.inv_freq") else name


LLAMA = Architecture(
    name="Llama",
    model_type="llama",
    hf_class="LlamaForCausalLM",
    embedding="model.embed_tokens.weight",
    mismatches=mismatches,
    hf_config=hf_config,
    course_args=course_args,
    to_hf=to_hf,
    from_hf=from_hf,
    read_name=read_name,
)
