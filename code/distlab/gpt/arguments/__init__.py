"""Megatron-LM's command line for ``pretrain_gpt.py``, as one typed dataclass (Megatron's
``training/arguments.py``).

    groups           the flags, one dataclass per Megatron group (_add_network_size_args, ...),
                     joined into PretrainArgs; fields (one flag as a field), training_groups
                     (training, learning rate, checkpoints, precision, validation, logging),
                     data_groups (data, tokenizer), refused (flags parsed only to be refused)
    parser           argparse built from them; --split
    validation       validate_args: everything checked before a process group exists -> the Layout
    architecture     the model's flags (RMSNorm, RoPE, SwiGLU, GQA, ...): Megatron's defaults and rules
    backends         the back ends' flags (DeepSpeed, FSDP2, DTensor, compile, checkpoint formats)
    samples          --train-iters or --train-samples and their schedule flags; --decoupled-lr
    data_checks      the data source and the tokenizer's files
    implementations  flags that only choose an implementation: the start-up lines saying what runs
"""

from distlab.gpt.arguments.backends import deepspeed_run_config
from distlab.gpt.arguments.groups import PretrainArgs
from distlab.gpt.arguments.parser import (
    ArgumentError,
    as_list,
    build_parser,
    parse_args,
    parse_split,
)
from distlab.gpt.arguments.validation import build_layout, validate_args, virtual_stages

__all__ = [
    "ArgumentError",
    "PretrainArgs",
    "as_list",
    "build_layout",
    "build_parser",
    "deepspeed_run_config",
    "parse_args",
    "parse_split",
    "validate_args",
    "virtual_stages",
]
