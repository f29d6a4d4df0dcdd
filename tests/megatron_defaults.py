"""Megatron-LM's command-line defaults, for the flags this engine shares with it (test fixture: CI
has no Megatron-LM clone). ``megatron_defaults.json`` is what Megatron-LM's own parser says; to
refresh it against a newer Megatron-LM, from a checkout of it (Python >= 3.12, or 3.11 with the
shim below) and this repository's environment::

    PYTHONPATH=/path/to/Megatron-LM:code python tests/megatron_defaults.py /path/to/Megatron-LM

It builds Megatron's parser (``megatron.training.arguments.add_megatron_arguments``), parses an
empty command line, and keeps, for each destination this engine's parser also has, the flag
spellings and the default (``repr`` where JSON has no such value, e.g. an enum).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import typing
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("megatron_defaults.json")


def load() -> dict:
    """``{"commit": ..., "defaults": {dest: {"flags": [...], "default": ...}}}``."""
    return json.loads(SNAPSHOT.read_text())


def main(megatron: str) -> None:
    if not hasattr(typing, "override"):  # Megatron-LM uses Python 3.12's typing.override
        typing.override = lambda f: f
    from megatron.training.arguments import add_megatron_arguments

    from distlab.gpt.arguments.parser import build_parser

    theirs = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ours = {a.dest for a in build_parser()._actions if a.option_strings}
    defaults = {}
    for action in theirs._actions:
        if action.dest in ours and action.option_strings and action.dest != "help":
            value = action.default
            try:
                json.dumps(value)
            except TypeError:
                value = repr(value)
            defaults[action.dest] = {"flags": action.option_strings, "default": value}
    commit = subprocess.run(["git", "-C", megatron, "rev-parse", "HEAD"], capture_output=True, text=True)
    snapshot = {"source": "NVIDIA/Megatron-LM", "commit": commit.stdout.strip() or None, "defaults": defaults}
    SNAPSHOT.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    print(f"{len(defaults)} flags -> {SNAPSHOT}")


if __name__ == "__main__":
    main(sys.argv[1])
