"""The course's Llama with ``--add-qkv-bias`` <-> transformers' ``Qwen2ForCausalLM``, weight by weight.

A Qwen2 is the Llama of ``llama.py`` (the same names, layouts, RoPE, norms, SwiGLU, tied or untied
output) with a bias on q, k and v and on nothing else: Megatron-LM's ``--add-qkv-bias`` with
``--disable-bias-linear`` (megatron-core gives ``linear_qkv`` a bias when ``add_bias_linear or
add_qkv_bias``). The biases fuse as the weights' rows do (``llama.split_qkv``)::

    course                            Qwen2ForCausalLM (``model.layers.l.`` before each)
    layers.l.attn.qkv.bias ((n+2g)d,) self_attn.q_proj.bias (n d,), k_proj.bias, v_proj.bias (g d,)
        (group, [r query heads, k, v], d) order, as qkv.weight's rows

Configuration: as ``llama.py`` (``hidden_act`` silu, ``rope_parameters``), without ``attention_bias``
and ``mlp_bias`` (Qwen2's biases are fixed). Sliding-window attention (``use_sliding_window`` with
a ``sliding_window`` shorter than ``max_position_embeddings`` on the layers from
``max_window_layers`` on: transformers' ``layer_types``) is refused by name, as Mistral's.
"""

from __future__ import annotations

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.inference import llama
from distlab.gpt.inference.architecture import Architecture, Needs, StateDict, unmet
from distlab.gpt.inference.mistral import refuse_sliding_window
from distlab.gpt.transformer.config import GPTConfig

NEEDS: Needs = {"num_experts": (None, "no --num-experts"), **llama.NEEDS,
                "add_qkv_bias": (True, "--add-qkv-bias")}  # fmt: skip


def mismatches(args: PretrainArgs) -> list[str]:
    return unmet(args, NEEDS)


def hf_config(cfg: GPTConfig, args: PretrainArgs) -> dict:
    config = llama.hf_config(cfg, args)
    del config["attention_bias"], config["mlp_bias"]  # Qwen2's are fixed: q/k/v only
    return config | {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "use_sliding_window": False,
        "sliding_window": None,
    }


def course_args(config: dict) -> dict:
    c = llama.standard(config)
    sliding = "sliding_attention" in (c.get("layer_types") or [])
    refuse_sliding_window(c, "qwen2", c.get("sliding_window") if sliding else None)
    no_biases = {k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias")}  # not Qwen2's
    return llama.course_args(no_biases) | {"add_qkv_bias": True}


def to_hf(sd: StateDict, cfg: GPTConfig) -> StateDict:
    out = llama.to_hf(sd, cfg)
    for i in range(cfg.num_layers):
        q, k, v = llama.split_qkv(sd[f"layers.{i}.attn.qkv.bias"], cfg)
        out |= {
            f"model.layers.{i}.self_attn.{p}_proj.bias": b.contiguous()
            for p, b in zip("qkv", (q, k, v), strict=True)
        }
    return out


def from_hf(sd: StateDict, cfg: GPTConfig) -> StateDict:
    out = llama.from_hf(sd, cfg)
    for i in range(cfg.num_layers):
        q, k, v = (sd[f"model.layers.{i}.self_attn.{p}_proj.bias"] for p in "qkv")
        out[f"layers.{i}.attn.qkv.bias"] = llama.fuse_qkv(q, k, v, cfg).contiguous()
    return out


QWEN2 = Architecture(
    name="Llama with q/k/v biases (Qwen2 architecture)",
    model_type="qwen2",
    hf_class="Qwen2ForCausalLM",
    embedding="model.embed_tokens.weight",
    mismatches=mismatches,
    hf_config=hf_config,
    course_args=course_args,
    to_hf=to_hf,
    from_hf=from_hf,
    read_name=llama.read_name,
)
