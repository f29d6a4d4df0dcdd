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
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HousekeepingConfig:
    """Megatron-LM's ``--manual-gc*`` and ``--empty-unused-memory-level`` flags."""

    manual_gc: bool = False
    """Python's threshold collector off; collections at the points below only."""
    manual_gc_interval: int = 0
    """With ``manual_gc``: collect every this many iterations (0: never)."""
    manual_gc_eval: bool = True
    """With ``manual_gc``: collect before and after each validation."""
    empty_unused_memory_level: int = 0
    """1 or 2: ``torch.cuda.empty_cache()`` after each step; 0: never."""


def start_manual_gc(config: HousekeepingConfig) -> None:
    """Before the first step: collect once, then no threshold collections."""
    if config.manual_gc:
        gc.disable()
        gc.collect()


def collect_after_step(config: HousekeepingConfig, iteration: int) -> None:
    if config.manual_gc and config.manual_gc_interval and iteration % config.manual_gc_interval == 0:
        gc.collect()


def collect_around_validation(config: HousekeepingConfig) -> None:
    if config.manual_gc and config.manual_gc_eval:
        gc.collect()


def stop_manual_gc(config: HousekeepingConfig) -> None:
    """After training: the interpreter's collector again (the process may go on: tests, notebooks)."""
    if config.manual_gc:
        gc.enable()


def empty_unused_memory(config: HousekeepingConfig, device: torch.device) -> None:
    if config.empty_unused_memory_level >= 1 and device.type == "cuda":
        torch.cuda.empty_cache()
