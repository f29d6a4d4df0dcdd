"""Megatron's housekeeping between steps: ``--manual-gc`` and ``--empty-unused-memory-level``.

``--manual-gc``: Python's threshold garbage collector runs whenever enough objects were allocated,
at a different moment on every rank, and a rank that collects delays the collective all others
wait in. Megatron turns it off (``gc.disable()``, after one ``gc.collect()``) and collects at the
same points on every rank: every ``--manual-gc-interval`` iterations (0: never) and before and
after each validation (unless ``--no-manual-gc-eval``). Reference cycles then live until such a
point; reference counting still frees everything else at once.

``--empty-unused-memory-level``: ``torch.cuda.empty_cache()`` returns the caching allocator's
unused blocks to the driver (1: after each step's forward/backward, 2: also after the optimizer);
here both after the whole step, which the training loop sees. A CPU has no such cache.
"""

from __future__ import annotations

import gc

import torch

from distlab.gpt.arguments import PretrainArgs


def start_manual_gc(args: PretrainArgs) -> None:
    """Before the first step: collect once, then no threshold collections."""
    if args.manual_gc:
        gc.disable()
        gc.collect()


def collect_after_step(args: PretrainArgs, iteration: int) -> None:
    if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
        gc.collect()


def collect_around_validation(args: PretrainArgs) -> None:
    if args.manual_gc and args.manual_gc_eval:
        gc.collect()


def stop_manual_gc(args: PretrainArgs) -> None:
    """After training: the interpreter's collector again (the process may go on: tests, notebooks)."""
    if args.manual_gc:
        gc.enable()


def empty_unused_memory(args: PretrainArgs, device: torch.device) -> None:
    if args.empty_unused_memory_level >= 1 and device.type == "cuda":
        torch.cuda.empty_cache()
