"""The learner's file on spawned gloo ranks, and the verdicts of :mod:`distlab.checks`' contract.

A notebook cell cannot hand a function it defines to a spawned process (it is pickled by name,
and ``__main__`` of a kernel is not importable), so the learner writes the exercise into a file
with ``%%writefile jobs/<name>.py``; :func:`run_on_ranks` starts ``world`` ranks of one gloo group
(:func:`distlab.local_ranks.spawn_ranks`, a free port), each of which imports that file
(:func:`load_file`) and runs the exercise's ``body(rank, module, *args) -> dict``. Whatever the
learner's code raises is caught in the rank and reported (:func:`learner_error`), so a wrong answer
never leaves a traceback of the checker; the dicts come back through JSON files, one per rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch.multiprocessing import ProcessRaisedException

from distlab import progress
from distlab.checks import ExerciseError, script_untouched
from distlab.local_ranks import free_port, spawn_ranks, torchrun_env

TIMEOUT_S = 60.0
"""How long a collective waits for a missing peer: a learner's code that hangs one rank fails the
check after this long instead of hanging the notebook."""


def file_untouched(path: str | Path) -> bool:
    """True while the learner's file is missing or still holds ``FIXME``."""
    return not Path(path).is_file() or script_untouched(path)


def not_yet(name: str, what: str) -> bool:
    """Say that exercise ``name`` is not done yet (``what`` to do), record it, return False."""
    print(f"[not yet] {name}: {what}")
    progress.record(name, "not yet")
    return False


def verdict(name: str, problem: str | None, right: str) -> bool:
    """Raise :class:`ExerciseError` naming ``problem``, or print ``[ok] name: right``; recorded."""
    progress.record(name, "wrong" if problem else "ok")
    if problem:
        raise ExerciseError(f"{name}: {problem}")
    print(f"[ok] {name}: {right}")
    return True


def share(x: float) -> str:
    """A difference relative to a change, in words: ``12.5%``, or ``3.7e-06`` below 0.1%."""
    return f"{x:.1%}" if x >= 0.001 else f"{x:.1e}"


def load_file(path: str | Path, name: str) -> ModuleType:
    """Import the learner's file as module ``name`` (its own code runs now)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    spec.loader.exec_module(module)
    return module


def learner_error(exc: BaseException, path: str | Path) -> str:
    """``ExcType: message (file, line n: the line)``, at the learner's file's deepest frame."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == Path(path)]
    where = f" ({Path(path).name}, line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
    return f"{''.join(traceback.format_exception_only(exc)).strip()}{where}"


def _rank(rank: int, world: int, port: int, body: Callable, path: str, out: str, args: tuple) -> None:
    from distlab.distributed import init_distributed, shutdown

    os.environ.update(torchrun_env(rank, world, port))
    torch.set_num_threads(1)  # the ranks share the notebook's cores
    init_distributed("gloo", timeout_s=TIMEOUT_S)
    try:
        try:
            module = load_file(path, f"learner_{Path(path).stem}")
        except Exception as exc:  # noqa: BLE001 - the learner's file may fail anywhere; report it
            result = {"error": learner_error(exc, path)}
        else:
            result = body(rank, module, *args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        shutdown()


def run_on_ranks(body: Callable, path: str | Path, world: int, *args) -> list[dict]:
    """``body(rank, learner_module, *args)`` on ``world`` spawned gloo ranks; their dicts by rank.

    ``body`` must be a module-level function (it is pickled by name) and must catch what the
    learner's code raises (:func:`learner_error`); the learner's file is imported in each rank.
    """
    with tempfile.TemporaryDirectory() as out:
        for attempt in (1, 2):
            try:
                spawn_ranks(_rank, (world, free_port(), body, str(Path(path).resolve()), out, args), world)
                break
            except ProcessRaisedException as exc:  # another process took the free port meanwhile: once more
                if attempt == 2 or "address already in use" not in str(exc).lower():
                    raise
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
