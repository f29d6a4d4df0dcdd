"""One flag as a dataclass field: its default and its argparse metadata (``help``, ``choices``,
``nargs``...; ``flag=`` spells the flag when it is not ``--`` + the field's name with dashes,
``action="store_false"`` makes a ``--no-*`` switch of a field that defaults to True, ``tf=True``
a boolean given as ``True|False``)."""

from __future__ import annotations

from dataclasses import field


def _f(default, help: str, **kw):  # noqa: A002 - argparse's own word
    if isinstance(default, list):  # a fresh list per instance (dataclasses refuse a shared one)
        return field(default_factory=default.copy, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})
