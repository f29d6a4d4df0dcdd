"""The course's Llama-MoE <-> transformers' ``MixtralForCausalLM``, weight by weight.

A Mixtral is the Llama of ``llama.py`` (embeddings, RMSNorms, grouped-query attention with RoPE,
untied or tied output: the same mapping) whose every MLP is a mixture of E SwiGLU experts with top-k
routing: the course's ``--num-experts E --moe-router-topk k --swiglu --disable-bias-linear``
(``transformer/moe/``). Per block l and expert e, F = ``--ffn-hidden-size`` (``intermediate_size``)::

    course                                    Mixtral's safetensors (``model.layers.l.`` before each)
    layers.l.mlp.router.weight        (E, H)  block_sparse_moe.gate.weight               same
    layers.l.mlp.experts.e.fc1.weight (2F, H) block_sparse_moe.experts.e.w1.weight = rows [:F] (gate)
        [W_gate; W_up] (``transformer/moe/experts.py``)   block_sparse_moe.experts.e.w3.weight = rows [F:] (up)
    layers.l.mlp.experts.e.fc2.weight (H, F)  block_sparse_moe.experts.e.w2.weight (down)  same

These are the names in the file. transformers 5 holds the experts fused in memory
(``MixtralExperts``: ``mlp.experts.gate_up_proj`` (E, 2F, H), each expert's ``[w1; w3]``, which is
the course's fc1, and ``mlp.experts.down_proj`` (E, H, F); the router is ``mlp.gate``), and its
``conversion_mapping.py`` turns the file's names into those when loading and back when saving:
``save_pretrained`` writes, and ``from_pretrained`` reads, the per-expert names above (5.23.0,
checked). A file in the fused names is refused by the shape check (names not in the configuration).

**Routing computes the same weights.** The course takes the top-k router logits and a softmax over
those k (``transformer/moe/router.py``, Megatron's default); Mixtral (``MixtralTopKRouter``) a softmax over all E,
the top k of it, divided by their sum: exp(z_i) / sum_{j in top-k} exp(z_j) both, over the same k
experts (the softmax keeps the order). Each expert is silu(x W_gate^T) * (x W_up^T) W_down^T, the
output the routing weights' sum, dropless on both sides (so no ``--moe-expert-capacity-factor``).

Configuration: ``num_local_experts`` E, ``num_experts_per_tok`` k, ``router_aux_loss_coef``
``--moe-aux-loss-coeff`` (training only, as ``router_jitter_noise``, which is not converted);
``sliding_window`` must be null or cover ``max_position_embeddings`` (the course attends to every
earlier position); the rest as ``llama.py``.
"""

from __future__ import annotations

import functools

import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.inference import llama
from distlab.gpt.inference.architecture import Architecture, ConversionError, Needs, StateDict, unmet
from distlab.gpt.transformer.config import GPTConfig

NEEDS: Needs = {
    "num_experts": (lambda e: e is not None, "--num-experts E"),
    "moe_expert_capacity_factor": (
        lambda c: c is None or c < 0,
        "no --moe-expert-capacity-factor (dropless)",
    ),
    **llama.NEEDS,
}
MOE = "block_sparse_moe"  # the MLP's name in Mixtral's files


def mismatches(args: PretrainArgs) -> list[str]:
    return unmet(args, NEEDS)


def hf_config(cfg: GPTConfig, args: PretrainArgs) -> dict:
    config = llama.hf_config(cfg, args)
    del config["attention_bias"], config["mlp_bias"]  # Mixtral has neither
    return config | {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.topk,
        "router_aux_loss_coef": cfg.moe.aux_loss_coeff,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def course_args(config: dict) -> dict:
    c = llama.standard(config)
    window, positions = c.get("sliding_window"), c["max_position_embeddings"]
    if window is not None and window < positions:
        raise ConversionError(
            f"this mixtral model attends to the last sliding_window {window} positions of its "
            f"max_position_embeddings {positions}: the course attends to all of them (no flag limits it)"
        )
    no_biases = {k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias")}  # not Mixtral's
    return llama.course_args(no_biases) | {
        "num_experts": c["num_local_experts"],
        "moe_router_topk": c["num_experts_per_tok"],
        "moe_aux_loss_coeff": [float(c["router_aux_loss_coef"])],
    }


def moe_to_hf(sd: StateDict, c: str, h: str, cfg: GPTConfig) -> StateDict:
    out = {f"{h}{MOE}.gate.weight": sd[f"{c}mlp.router.weight"]}  # (E, H)
    for e in range(cfg.moe.num_experts):
        gate, up = sd[f"{c}mlp.experts.{e}.fc1.weight"].chunk(2)  # (F, H) each
        x = f"{h}{MOE}.experts.{e}."
        out |= {
            f"{x}w1.weight": gate,
            f"{x}w3.weight": up,
            f"{x}w2.weight": sd[f"{c}mlp.experts.{e}.fc2.weight"],
        }
    return out


def moe_from_hf(sd: StateDict, c: str, h: str, cfg: GPTConfig) -> StateDict:
    out = {f"{c}mlp.router.weight": sd[f"{h}{MOE}.gate.weight"]}
    for e in range(cfg.moe.num_experts):
        x, y = f"{h}{MOE}.experts.{e}.", f"{c}mlp.experts.{e}."
        out[f"{y}fc1.weight"] = torch.cat([sd[f"{x}w1.weight"], sd[f"{x}w3.weight"]])  # (2F, H)
        out[f"{y}fc2.weight"] = sd[f"{x}w2.weight"]
    return out


MIXTRAL = Architecture(
    name="Llama-MoE (Mixtral architecture)",
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    embedding="model.embed_tokens.weight",
    mismatches=mismatches,
    hf_config=hf_config,
    course_args=course_args,
    to_hf=functools.partial(llama.to_hf, mlp=moe_to_hf),
    from_hf=functools.partial(llama.from_hf, mlp=moe_from_hf),
    read_name=llama.read_name,
)
