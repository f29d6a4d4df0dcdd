"""The model families the converter and ``generate.py`` know, one small module each:

    gpt2.py     the course GPT (learned positions, LayerNorm, GeLU, tied output) <-> GPT2LMHeadModel
    llama.py    the course's Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention) <-> LlamaForCausalLM
    mixtral.py  the Llama with top-k routed SwiGLU experts (--num-experts) <-> MixtralForCausalLM
    qwen2.py    the Llama with q/k/v biases (--add-qkv-bias) <-> Qwen2ForCausalLM
    mistral.py  MistralForCausalLM without sliding-window attention -> the Llama (read only)

A new family is a module that fills an :class:`~distlab.gpt.inference.architecture.Architecture`,
and one entry in :data:`KNOWN`.
"""

from __future__ import annotations

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.inference.architecture import Architecture, ConversionError
from distlab.gpt.inference.gpt2 import GPT2
from distlab.gpt.inference.llama import LLAMA
from distlab.gpt.inference.mistral import MISTRAL
from distlab.gpt.inference.mixtral import MIXTRAL
from distlab.gpt.inference.qwen2 import QWEN2

KNOWN: tuple[Architecture, ...] = (GPT2, LLAMA, MIXTRAL, QWEN2)
#: Read in only: a course run that builds one is written as another family (``mistral.py``).
READ_ONLY: tuple[Architecture, ...] = (MISTRAL,)


def for_args(args: PretrainArgs) -> Architecture:
    """The family a course run built, or :class:`ConversionError` naming, per family (the closest
    first), the flags the run would need."""
    for arch in KNOWN:
        if not arch.mismatches(args):
            return arch
    closest = sorted(KNOWN, key=lambda arch: len(arch.mismatches(args)))
    needs = "; ".join(f"{arch.name} needs {', '.join(arch.mismatches(args))}" for arch in closest)
    raise ConversionError(f"no converter knows this course model: {needs}")


def for_hf(config: dict, where: str) -> Architecture:
    """The family of a transformers ``config.json`` (its ``model_type`` and ``architectures``)."""
    model_type, classes = config.get("model_type"), config.get("architectures") or []
    for arch in KNOWN + READ_ONLY:
        if model_type == arch.model_type:
            if classes and arch.hf_class not in classes:
                raise ConversionError(
                    f"{where}: architectures {classes} has no {arch.hf_class}: the converter reads "
                    f"{arch.hf_class} for model_type {model_type!r}"
                )
            return arch
    from transformers import CONFIG_MAPPING  # model_type -> config class, for every model it has

    known_types = [a.model_type for a in KNOWN + READ_ONLY]
    if model_type not in CONFIG_MAPPING:
        raise ConversionError(
            f"{where}: model_type {model_type!r} is not an architecture transformers has; "
            f"the converter reads model_type {known_types}"
        )
    raise ConversionError(
        f"{where}: model_type {model_type!r} ({classes}) is a transformers architecture the converter "
        f"does not know; it reads model_type {known_types}"
    )
