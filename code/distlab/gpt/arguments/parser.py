"""argparse from :class:`~distlab.gpt.arguments.groups.PretrainArgs`: one flag per field, spelt
as Megatron spells it, plus the command line's small parsers (``--split``)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

from distlab.gpt.arguments.groups import PretrainArgs


class ArgumentError(ValueError):
    """Bad or contradictory command-line arguments (raised before any compute)."""


def _str2bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """argparse with one flag per field, spelt as Megatron spells it."""
    parser = argparse.ArgumentParser(description="Megatron-style GPT pretraining", allow_abbrev=False)
    hints = typing.get_type_hints(PretrainArgs)
    for f in dataclasses.fields(PretrainArgs):
        meta = dict(f.metadata)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        help_ = meta.pop("help")
        tf = meta.pop("tf", False)
        kind = hints[f.name]
        if kind is bool and tf:
            parser.add_argument(
                flag, type=_str2bool, default=f.default, dest=f.name, metavar="True|False", help=help_
            )
        elif kind is bool:  # a switch; "store_false": --no-* of a field that defaults to True
            parser.add_argument(flag, action=meta.pop("action", "store_true"), dest=f.name, help=help_)
        else:
            meta.setdefault("type", kind)
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            parser.add_argument(flag, default=default, dest=f.name, help=help_, **meta)
    parser.add_argument("--local_rank", type=int, dest="local_rank", help=argparse.SUPPRESS)  # old launchers
    parser.add_argument(  # Megatron-LM's current name for the same field
        "--num-virtual-stages-per-pipeline-rank", type=int, dest="virtual_pipeline_model_parallel_size",
        help="the same as --virtual-pipeline-model-parallel-size",
    )  # fmt: skip
    parser.add_argument(  # Megatron-LM's switch for the same field
        "--torch-fsdp2-no-reshard-after-forward", action="store_false", dest="torch_fsdp2_reshard_after_forward",
        help="the same as --torch-fsdp2-reshard-after-forward False",
    )  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> PretrainArgs:
    """Parse a command line; unknown flags exit with argparse's message naming them."""
    ns = build_parser().parse_args(argv)
    return PretrainArgs(**vars(ns))


def parse_split(split: str) -> list[float]:
    """``"949,50,1"`` -> ``[0.949, 0.05, 0.001]`` (missing parts are 0). As Megatron, the numbers
    are read out of the text, so that ``'99,1,0'`` with its quotes (what ``"--split '99,1,0'"``
    becomes in a bash array expanded unquoted, as Megatron's Llama 3 example does) is 99,1,0."""
    parts = [float(s) for s in re.findall(r"[.0-9]+", split)]  # Megatron's reading: the numbers in it
    if not parts or re.sub(r"[.0-9,/'\"\s]", "", split):
        raise ValueError(f"--split {split!r} must be numbers separated by commas, e.g. 949,50,1")
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r} must be 1 to 3 non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def as_list(value) -> list:
    """A flag of Megatron's ``nargs='+'`` as a list: its default is one value, a given flag a list."""
    return list(value) if isinstance(value, (list, tuple)) else [value]
