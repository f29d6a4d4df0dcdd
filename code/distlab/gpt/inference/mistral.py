"""transformers' ``MistralForCausalLM`` -> the course's Llama (``llama.py``), read only.

A Mistral is a Llama with the same weight names and layouts (grouped-query attention, RoPE,
RMSNorm, SwiGLU, no bias) and one more option, sliding-window attention: with ``sliding_window`` w
each position attends to the last w positions only. The course attends to every earlier position
(Megatron-LM's ``--window-size`` is not built), so a Mistral whose window is shorter than its
``max_position_embeddings`` (Mistral 7B v0.1: 4096 of 32768) is refused by name; one without a
window (``null``: v0.2 and v0.3) or with one that covers every position computes what the course
computes, and is read as a Llama. Written out, the course's model is a ``LlamaForCausalLM``
(the same function: transformers has nothing that tells the two apart but the window).
"""

from __future__ import annotations

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.inference import llama
from distlab.gpt.inference.architecture import Architecture, ConversionError


def refuse_sliding_window(c: dict, model_type: str, window: int | None) -> None:
    """A standard config ``c`` whose attention looks back ``window`` positions (None: all of them)."""
    positions = c["max_position_embeddings"]
    if window is not None and window < positions:
        raise ConversionError(
            f"this {model_type} model uses sliding-window attention: sliding_window {window} of its "
            f"max_position_embeddings {positions} positions; the course attends to all of them (Megatron-LM's "
            f"--window-size is not built here). A {model_type} without the window (sliding_window null) converts"
        )


def course_args(config: dict) -> dict:
    c = llama.standard(config)
    refuse_sliding_window(c, "mistral", c.get("sliding_window"))
    return llama.course_args({k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias")})


def _written_as_llama(args: PretrainArgs) -> list[str]:
    return ["nothing: a course Llama is written as LlamaForCausalLM"]


MISTRAL = Architecture(
    name="Llama (Mistral architecture)",
    model_type="mistral",
    hf_class="MistralForCausalLM",
    embedding="model.embed_tokens.weight",
    mismatches=_written_as_llama,
    hf_config=llama.hf_config,
    course_args=course_args,
    to_hf=llama.to_hf,
    from_hf=llama.from_hf,
    read_name=llama.read_name,
)
