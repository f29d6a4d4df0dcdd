"""The run's checkpoints (a :class:`CheckpointConfig`): saves in ``--ckpt-format``'s format
(``--async-save`` included), their save line, and ``--load`` in the format it finds there.

    torch_dist   dist_checkpointing.py   DCP: every rank writes its part; N ranks load into M (the default)
    torch        checkpointing.py        Megatron's legacy layout: one file per (tp, pp, ep) rank

As Megatron-LM's ``_load_base_checkpoint``, a load reads the folder's own format
(``checkpointing.saved_format``), whatever the run saves in: a release checkpoint (the legacy
layout, what ``convert_checkpoint.py --from hf`` writes) continues in a run that saves torch_dist.

``dist_checkpointing`` is imported only by runs that save or load ``torch_dist``: DCP imports
``torch.distributed.fsdp``, and a DeepSpeed ZeRO-2 run in a process that has imported it leaves
one gloo group's threads alive after ``pretrain`` returns (found by bisection; the cause lies
between DeepSpeed and torch and is not ours to fix), which is the exit-time abort
``distributed.shutdown`` exists to prevent (``tests/test_gpt_memory_driver.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.checkpointing import checkpointing
from distlab.gpt.checkpointing.checkpoint_config import CheckpointConfig
from distlab.gpt.checkpointing.checkpointing import Snapshot
from distlab.gpt.parallel_state import ParallelState
from distlab.log_line import LogLine, Opt

#: The save line of either format; ``blocking_ms == total_ms`` unless ``mode`` is "async".
SAVED = LogLine(
    "  successfully saved checkpoint at iteration {iteration:7d} to {folder} in {format} format",
    Opt(" ({mode})"),
    " | blocking {blocking_ms:.1f} ms | total {total_ms:.1f} ms",
)


def _dcp():
    from distlab.gpt.checkpointing import dist_checkpointing

    return dist_checkpointing


@dataclasses.dataclass
class _InFlight:
    """An asynchronous save not yet reported: its commit, its iteration, its clock."""

    committed: Future
    iteration: int
    started: float
    blocking_s: float


class Checkpointer:
    """The run's saves under ``config.save`` in ``config.ckpt_format``, their save lines, and the load.

    ``save`` writes (torch, torch_dist) or starts the write (``--async-save``: at most one in
    flight, the next ``save`` waits for it); ``poll`` reports an asynchronous save that has
    completed; ``wait`` blocks until it has (the end of training). Each returns the save lines
    to print (rank 0 prints them), none while a write is in flight. ``load`` reads ``config.load``."""

    def __init__(self, config: CheckpointConfig, state: ParallelState, device: torch.device) -> None:
        self.config, self.state, self.device = config, state, device
        self.group: dist.ProcessGroup | None = None  # the async writes' gloo group, made at the first
        self.in_flight: _InFlight | None = None

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, dict | None] | None:
        """``--load`` in the format of the checkpoint there (``--ckpt-format``'s when there is none)."""
        torch_dist = (checkpointing.saved_format(self.config.load) or self.config.ckpt_format) == "torch_dist"
        load = _dcp().load_checkpoint if torch_dist else checkpointing.load_checkpoint
        return load(self.config, self.state, model, optimizer)

    def save(self, saved: Snapshot) -> list[str]:
        started, iteration = self._clock(), saved.iteration
        lines = self.wait()  # the previous write: the folder is free, its line printed
        state = (self.config, self.state, saved)
        if not self.config.async_save:
            torch_dist = self.config.ckpt_format == "torch_dist"
            save = _dcp().save_checkpoint if torch_dist else checkpointing.save_checkpoint
            save(*state)
            elapsed = self._clock() - started
            return [*lines, self._line(iteration, elapsed, elapsed)]
        if self.group is None:  # collective: every rank saves at the same iteration
            timeout = datetime.timedelta(minutes=self.config.distributed_timeout_minutes)
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        committed = _dcp().async_save_checkpoint(*state, group=self.group)
        self.in_flight = _InFlight(committed, iteration, started, self._clock() - started)
        return lines

    def poll(self) -> list[str]:
        """The line of the asynchronous save in flight if it has completed."""
        if self.in_flight is not None and self.in_flight.committed.done():
            return self.wait()
        return []

    def wait(self) -> list[str]:
        """Block until the asynchronous save in flight is committed (its error raises here); its line."""
        if self.in_flight is None:
            return []
        save, self.in_flight = self.in_flight, None
        finished = save.committed.result()
        return [self._line(save.iteration, save.blocking_s, finished - save.started, mode="async")]

    def _clock(self) -> float:
        if self.device.type == "cuda":  # the step's kernels are not the save's time
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _line(self, iteration: int, blocking_s: float, total_s: float, mode: str | None = None) -> str:
        return SAVED.format(iteration=iteration, folder=self.config.save, format=self.config.ckpt_format,
                            mode=mode, blocking_ms=1000 * blocking_s, total_ms=1000 * total_s)  # fmt: skip
