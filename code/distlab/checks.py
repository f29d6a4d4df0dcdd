"""Exercises that check themselves.

Every exercise in the notebooks leaves placeholders for the learner (``FIXME`` in Python, ``#FIXME``
in a batch script) and is followed by a check cell::

    answer = FIXME                                  # the learner's cell
    check("ranks on node2", answer, expected=[2, 3], hint="Megatron puts consecutive ranks on one node")

The contract of :func:`check`:

* the answer is right: prints ``[ok] ...`` and returns True;
* the exercise is untouched (still ``FIXME``, or ``...``): prints ``[not yet] ...`` and returns False,
  so that a notebook executed top to bottom (by CI, or by a learner skipping ahead) does not fail;
* the answer is wrong: raises :class:`ExerciseError` with the answer and the hint (and the expected
  value only with ``reveal=True``: a check should not give the answer away).

In a workshop, each outcome is also recorded for the instructor (:mod:`distlab.progress`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distlab import progress

FIXME = "FIXME"
"""The placeholder learners replace; any string containing it counts as untouched."""


class ExerciseError(AssertionError):
    """A wrong answer: the message names the answer, what was expected and a hint."""


def untouched(*answers: Any) -> bool:
    """True while any answer is still a placeholder: ``FIXME`` (or a string holding it) or ``...``."""
    for a in answers:
        if a is Ellipsis or (isinstance(a, str) and FIXME in a):
            return True
        if isinstance(a, (list, tuple, set)) and untouched(*a):
            return True
        if isinstance(a, dict) and untouched(*a.values()):
            return True
    return False


def script_untouched(path: str | Path) -> bool:
    """True while a batch script written by the learner still contains ``FIXME``."""
    return FIXME in Path(path).read_text()


def _close(answer: Any, expected: Any, rel: float) -> bool:
    if isinstance(expected, float) or isinstance(answer, float):
        try:
            return math.isclose(float(answer), float(expected), rel_tol=rel, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    if isinstance(expected, (list, tuple)) and isinstance(answer, (list, tuple)):
        return len(answer) == len(expected) and all(
            _close(a, e, rel) for a, e in zip(answer, expected, strict=True)
        )
    return answer == expected


def check(
    name: str,
    answer: Any,
    expected: Any = None,
    *,
    ok: Callable[[Any], bool] | None = None,
    hint: str = "",
    rel: float = 1e-6,
    reveal: bool = False,
) -> bool:
    """Check one answer: equal to ``expected`` (floats within ``rel``), or accepted by ``ok(answer)``.

    Returns True when right, False (with a note) while untouched; raises ExerciseError when wrong.
    """
    if (expected is None) == (ok is None):
        raise ValueError("check() takes exactly one of expected= or ok=")
    if untouched(answer):
        print(f"[not yet] {name}: replace FIXME with your answer, then run this cell again")
        progress.record(name, "not yet")
        return False
    right = ok(answer) if ok is not None else _close(answer, expected, rel)
    progress.record(name, "ok" if right else "wrong")
    if not right:
        want = f"; expected {expected!r}" if reveal and ok is None else ""
        raise ExerciseError(f"{name}: {answer!r} is not right{want}. {hint}".rstrip())
    print(f"[ok] {name}: {answer!r}")
    return True
