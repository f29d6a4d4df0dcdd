"""The course GPT <-> transformers' ``GPT2LMHeadModel``, weight by weight.

Both compute the same function: pre-LayerNorm blocks, learned positions, a tied output layer,
biases on every linear layer and LayerNorm. With H hidden, n heads of d = H / n, F = 4H (or
``n_inner``) and the padded vocabulary V (``transformer.`` is the prefix of every GPT-2 name but
``lm_head``; l is a block)::

    course (nn.Linear: weight (out, in))      GPT-2 (Conv1D: weight (in, out), y = x W + b)
    wte.weight          (V, H)                transformer.wte.weight          (V, H)  same
    wpe.weight          (T_max, H)            transformer.wpe.weight          (T_max, H)  same
    layers.l.ln1.{weight,bias}   (H,)         transformer.h.l.ln_1.{weight,bias}  same
    layers.l.attn.qkv.weight    (3H, H)       transformer.h.l.attn.c_attn.weight  (H, 3H)
        rows in (head, {q,k,v}, d) order      columns in ({q,k,v}, head, d) order: [q; k; v]
        qkv = c_attn^T viewed (3, n, d, H), the first two axes swapped, viewed (3H, H)
    layers.l.attn.qkv.bias      (3H,)         transformer.h.l.attn.c_attn.bias    (3H,)  the same swap
    layers.l.attn.proj.weight   (H, H)        transformer.h.l.attn.c_proj.weight  (H, H)  transposed
        (input features in (head, d) order on both sides: heads concatenated, then projected)
    layers.l.attn.proj.bias     (H,)          transformer.h.l.attn.c_proj.bias    same
    layers.l.ln2.{weight,bias}                transformer.h.l.ln_2.{weight,bias}  same
    layers.l.mlp.fc1.weight     (F, H)        transformer.h.l.mlp.c_fc.weight     (H, F)  transposed
    layers.l.mlp.fc1.bias       (F,)          transformer.h.l.mlp.c_fc.bias       same
    layers.l.mlp.fc2.weight     (H, F)        transformer.h.l.mlp.c_proj.weight   (F, H)  transposed
    layers.l.mlp.fc2.bias       (H,)          transformer.h.l.mlp.c_proj.bias     same
    ln_f.{weight,bias}                        transformer.ln_f.{weight,bias}      same
    (tied: E^T)                               lm_head.weight (V, H): tied to wte, not written
                                              (``tie_word_embeddings``; read only to check it is wte)

The course's column-parallel qkv keeps each head's q, k and v next to each other so that a
contiguous slice of rows is whole heads on a tp rank (``transformer/gpt_model.py``); GPT-2 splits
c_attn's output into three H-wide blocks. Configuration: ``layer_norm_epsilon`` is the run's
``--norm-epsilon`` (Megatron's default 1e-5, GPT-2's too); ``activation_function``
is ``"gelu"``, the exact erf GeLU of ``F.gelu``, or GPT-2's own ``"gelu_new"`` (transformers'
default; ``"gelu_pytorch_tanh"`` is the same function), the tanh approximation, which is
Megatron's ``--openai-gelu``; any other is refused on the way in;
``vocab_size`` is the padded V, all rows kept (the padded ids are never produced: see
``hf_checkpoint.py``'s ``suppress_tokens``); ``n_positions`` is T_max; dropouts are the run's
``--hidden-dropout`` (``resid_pdrop``, ``embd_pdrop``) and ``--attention-dropout`` (``attn_pdrop``).
"""

from __future__ import annotations

import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.inference.architecture import Architecture, ConversionError, Needs, StateDict, unmet
from distlab.gpt.transformer.config import GPTConfig

#: GPT-2 options whose other values compute something the course GPT does not.
MUST_BE = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}
#: Per block: course suffix -> (GPT-2 suffix, how): "same", "t" (Conv1D's transpose), "qkv".
BLOCK = {
    "ln1.weight": ("ln_1.weight", "same"), "ln1.bias": ("ln_1.bias", "same"),
    "attn.qkv.weight": ("attn.c_attn.weight", "qkv"), "attn.qkv.bias": ("attn.c_attn.bias", "qkv"),
    "attn.proj.weight": ("attn.c_proj.weight", "t"), "attn.proj.bias": ("attn.c_proj.bias", "same"),
    "ln2.weight": ("ln_2.weight", "same"), "ln2.bias": ("ln_2.bias", "same"),
    "mlp.fc1.weight": ("mlp.c_fc.weight", "t"), "mlp.fc1.bias": ("mlp.c_fc.bias", "same"),
    "mlp.fc2.weight": ("mlp.c_proj.weight", "t"), "mlp.fc2.bias": ("mlp.c_proj.bias", "same"),
}  # fmt: skip
TOP = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")  # transformer.<the same name>
#: ``activation_function`` -> ``--openai-gelu`` (transformers' default is gelu_new).
ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


#: The flags of the course GPT (the defaults): a run without them is another family.
NEEDS: Needs = {
    "num_experts": (None, "no --num-experts"),
    "normalization": ("LayerNorm", "--normalization LayerNorm"),
    "position_embedding_type": ("learned_absolute", "--position-embedding-type learned_absolute"),
    "swiglu": (False, "no --swiglu"),
    "add_bias_linear": (True, "no --disable-bias-linear"),
    "untie_embeddings_and_output_weights": (False, "no --untie-embeddings-and-output-weights"),
    "group_query_attention": (False, "no --group-query-attention"),
    "layernorm_zero_centered_gamma": (False, "no --apply-layernorm-1p"),
}


def mismatches(args: PretrainArgs) -> list[str]:
    heads = args.hidden_size // args.num_attention_heads
    wrong = (
        [] if args.kv_channels in (None, heads) else [f"no --kv-channels (the run has {args.kv_channels})"]
    )
    return unmet(args, NEEDS) + wrong


def hf_config(cfg: GPTConfig, args: PretrainArgs) -> dict:
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_position_embeddings,
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_attention_heads,
        "n_inner": cfg.ffn,
        "layer_norm_epsilon": cfg.layernorm_epsilon,
        "resid_pdrop": args.hidden_dropout,
        "embd_pdrop": args.hidden_dropout,
        "attn_pdrop": args.attention_dropout,
        "initializer_range": args.init_method_std,
        "activation_function": "gelu_new" if cfg.openai_gelu else "gelu",
        **MUST_BE,
    }


def course_args(config: dict) -> dict:
    wrong = {k: config.get(k, v) for k, v in MUST_BE.items() if config.get(k, v) != v}
    activation = config.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        wrong["activation_function"] = activation
    if wrong:
        want = {k: MUST_BE.get(k, " or ".join(ACTIVATIONS)) for k in wrong}
        raise ConversionError(
            f"this GPT-2 has {wrong}: the course GPT computes {want} "
            f"(exact GeLU or its tanh approximation with --openai-gelu, 1/sqrt(d) attention, tied output, no "
            f"cross-attention), so its outputs would differ from transformers'"
        )
    hidden = config.get("n_embd", 768)
    return {
        "num_layers": config.get("n_layer", 12),
        "hidden_size": hidden,
        "num_attention_heads": config.get("n_head", 12),
        "ffn_hidden_size": None if config.get("n_inner") in (None, 4 * hidden) else config["n_inner"],
        "max_position_embeddings": config.get("n_positions", 1024),
        "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5),
        "hidden_dropout": config.get("resid_pdrop", 0.1),
        "attention_dropout": config.get("attn_pdrop", 0.1),
        "init_method_std": config.get("initializer_range", 0.02),
        "openai_gelu": ACTIVATIONS[activation],
    }


def names(cfg: GPTConfig) -> list[tuple[str, str, str]]:
    """Every weight: (course name, GPT-2 name, how), in the model's order."""
    top = [(name, f"transformer.{name}", "same") for name in TOP]
    return top + [
        (f"layers.{i}.{course}", f"transformer.h.{i}.{hf}", how)
        for i in range(cfg.num_layers)
        for course, (hf, how) in BLOCK.items()
    ]


def _heads_major(w: torch.Tensor, n: int) -> torch.Tensor:
    """qkv rows (3H[, H]) ({q,k,v}, head, d) -> (head, {q,k,v}, d), GPT-2's -> the course's."""
    return w.unflatten(0, (3, n, -1)).transpose(0, 1).flatten(0, 2)


def _qkv_major(w: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse: (head, {q,k,v}, d) -> ({q,k,v}, head, d)."""
    return w.unflatten(0, (n, 3, -1)).transpose(0, 1).flatten(0, 2)


def to_hf(sd: StateDict, cfg: GPTConfig) -> StateDict:
    n, out = cfg.num_attention_heads, {}
    for course, hf, how in names(cfg):
        w = sd[course]
        if how == "qkv":
            w = _qkv_major(w, n)  # (3H, H) or (3H,)
        out[hf] = (w.t() if how in ("t", "qkv") and w.dim() == 2 else w).contiguous()  # Conv1D: (in, out)
    return out


def from_hf(sd: StateDict, cfg: GPTConfig) -> StateDict:
    n, out = cfg.num_attention_heads, {}
    for course, hf, how in names(cfg):
        w = sd[hf]
        w = w.t() if how in ("t", "qkv") and w.dim() == 2 else w  # (out, in)
        out[course] = (_heads_major(w, n) if how == "qkv" else w).contiguous()
    return out


def read_name(name: str) -> str | None:
    """Older GPT-2 files (OpenAI's, converted) name the blocks without the ``transformer.`` prefix;
    older transformers wrote the buffers ``attn.bias`` (the causal mask) and ``attn.masked_bias``."""
    if name.endswith((".attn.bias", ".attn.masked_bias")):
        return None
    return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"


GPT2 = Architecture(
    name="GPT (GPT-2 architecture)",
    model_type="gpt2",
    hf_class="GPT2LMHeadModel",
    embedding="transformer.wte.weight",
    mismatches=mismatches,
    hf_config=hf_config,
    course_args=course_args,
    to_hf=to_hf,
    from_hf=from_hf,
    read_name=read_name,
)
