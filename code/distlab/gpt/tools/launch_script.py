"""What a launch script passes to ``pretrain_gpt.py``, without starting anything.

Megatron-LM's example scripts build bash arrays and end in ``torchrun ${DISTRIBUTED_ARGS[@]}
pretrain_gpt.py ${MODEL_ARGS[@]} ...`` (unquoted: bash splits every element at white space and
keeps quotes). :func:`script_argv` runs the script with ``torchrun`` replaced by a shell function
that prints its arguments one per line, and returns the words after the entry script: exactly what
``pretrain_gpt.py`` would parse (``distlab.gpt.arguments.parse_args``), in the script's order.
"""

from __future__ import annotations

import os
import shlex
import subprocess

PRINT_TORCHRUN = 'torchrun() { printf "%s\\n" "$@"; }; export -f torchrun; '


def script_argv(
    script: str, *script_args: str, env: dict[str, str] | None = None, entry: str = "pretrain_gpt.py"
) -> list[str]:
    """The words after ``entry`` on the script's torchrun line (``env`` added to this environment)."""
    command = PRINT_TORCHRUN + shlex.join(["bash", script, *script_args])
    out = subprocess.run(["bash", "-c", command], env={**os.environ, **(env or {})}, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{script} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    words = out.stdout.splitlines()
    at = [i for i, w in enumerate(words) if w.endswith(entry)]
    if not at:
        raise ValueError(f"{script} runs no torchrun ... {entry} line (it printed {len(words)} words)")
    return words[at[-1] + 1 :]
