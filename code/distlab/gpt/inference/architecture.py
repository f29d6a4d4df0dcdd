"""The :class:`Architecture` record that each model family's module fills (``families.py`` lists them).

A family is: the flags a run must have (or leave out) to build it (:attr:`Architecture.mismatches`),
its transformers ``config.json`` from the run's ``GPTConfig`` (``to_configs.model_config``) and back
(as course argument values, refusing what the course cannot compute), and the two weight maps, each a
function of whole (unsharded) state dicts. Sharding, files and tokenizers are the same for every
family and live in ``course_checkpoint.py`` and ``hf_checkpoint.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.transformer.config import GPTConfig

StateDict = dict[str, torch.Tensor]


class ConversionError(ValueError):
    """Input the converter or ``generate.py`` refuses, before any weight is read: the message
    names the values and the fix."""


@dataclass(frozen=True)
class Architecture:
    """One model family's mapping between course checkpoints and transformers' folders."""

    name: str
    """The course's name for it (printed)."""
    model_type: str
    """transformers' ``config.json`` ``model_type`` ("gpt2")."""
    hf_class: str
    """The ``architectures`` entry ``AutoModelForCausalLM`` builds ("GPT2LMHeadModel")."""
    embedding: str
    """transformers' name of the token embedding E (V, H) in ``model.safetensors``."""
    mismatches: Callable[[PretrainArgs], list[str]]
    """What of a run's arguments this family is not (each naming the flag); empty: the run builds it."""
    hf_config: Callable[[GPTConfig, PretrainArgs], dict]
    """``config.json``'s fields (tokenizer ids left to ``hf_checkpoint``)."""
    course_args: Callable[[dict], dict]
    """A ``config.json`` -> course argument values; raises :class:`ConversionError` for a model
    the course cannot compute."""
    to_hf: Callable[[StateDict, GPTConfig], StateDict]
    """Course weights (global names, unsharded) -> transformers' names and layouts."""
    from_hf: Callable[[StateDict, GPTConfig], StateDict]
    """The inverse of :attr:`to_hf`."""
    read_name: Callable[[str], str | None] = field(default=lambda name: name)
    """A name in a ``model.safetensors`` -> the name :attr:`to_hf` gives it (older spellings), None
    for a buffer that is no weight."""


#: One flag a family needs: a ``PretrainArgs`` field -> (the value, or a test of it; the flag to give).
Needs = dict[str, tuple[object, str]]


def unmet(args: PretrainArgs, needs: Needs) -> list[str]:
    """The ``needs`` the arguments do not meet: "<the flag to give> (the run has <field> <value>)"."""
    return [
        f"{flag} (the run has {name} {getattr(args, name)!r})"
        for name, (want, flag) in needs.items()
        if not (want(getattr(args, name)) if callable(want) else getattr(args, name) == want)
    ]
