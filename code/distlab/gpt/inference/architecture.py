"""The :class:`Architecture` record that each model family's module fills (``families.py`` lists them).

A family is: the test that a run's arguments build it (:attr:`Architecture.matches`), its
``GPTConfig`` from those arguments, its transformers ``config.json`` from the ``GPTConfig`` and back
(as course argument values, refusing what the course cannot compute), and the two weight maps,
each a function of whole (unsharded) state dicts. Sharding, files and tokenizers are the same for
every family and live in ``course_checkpoint.py`` and ``hf_checkpoint.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.transformer.model import GPTConfig

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
    matches: Callable[[PretrainArgs], bool]
    """Whether a run with these arguments builds this family."""
    course_config: Callable[[PretrainArgs, int], GPTConfig]
    """The ``GPTConfig`` of one whole model (tp = pp = 1) for the arguments and the padded V."""
    hf_config: Callable[[GPTConfig, PretrainArgs], dict]
    """``config.json``'s fields (tokenizer ids left to ``hf_checkpoint``)."""
    course_args: Callable[[dict], dict]
    """A ``config.json`` -> course argument values; raises :class:`ConversionError` for a model
    the course cannot compute."""
    to_hf: Callable[[StateDict, GPTConfig], StateDict]
    """Course weights (global names, unsharded) -> transformers' names and layouts."""
    from_hf: Callable[[StateDict, GPTConfig], StateDict]
    """The inverse of :attr:`to_hf`."""
