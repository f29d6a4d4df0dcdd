"""The next step's micro-batches, read while the current step runs.

A step's batches are a pure function of the first sample of its global batch (``consumed``) and
its number of micro-batches (``training.micro_batches``), so reading them ahead changes nothing
but when they are read::

    take(c_i, m_i)        step i's batches: the ones read ahead if (c_i, m_i) was prefetched, else
                          read now; then copied to the device
    prefetch(c_i+1, m_i+1)  a worker thread reads step i + 1's while step i runs

With CUDA the worker also pins them (page-locked host memory), so that ``take``'s
``.to(device, non_blocking=True)`` returns at once and the copy is queued on the stream behind
the step before it: the host never waits for the device to take a batch (from pageable memory
the copy would wait for the queued step). On the CPU pinning and copying are no-ops: what
remains is the reading, off the training loop's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from distlab.gpt.interfaces import MicroBatch

#: read(first_sample, num_micro_batches) -> this rank's micro-batches of that global batch, on the host
ReadFn = Callable[[int, int], list[MicroBatch]]


class Prefetcher:
    """One global batch read ahead by one worker thread (see the module docstring)."""

    def __init__(self, read: ReadFn, device: torch.device) -> None:
        self.read, self.device = read, device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distlab-prefetch")
        self._pending: tuple[tuple[int, int], Future] | None = None

    def _host(self, first_sample: int, num_micro_batches: int) -> list[MicroBatch]:
        batches = self.read(first_sample, num_micro_batches)
        if self.device.type == "cuda":
            batches = [(tokens.pin_memory(), labels.pin_memory()) for tokens, labels in batches]
        return batches

    def prefetch(self, first_sample: int, num_micro_batches: int) -> None:
        """Start reading the global batch from ``first_sample`` (replacing one not taken)."""
        self._drop()
        key = (first_sample, num_micro_batches)
        self._pending = key, self._pool.submit(self._host, *key)

    def take(self, first_sample: int, num_micro_batches: int) -> list[MicroBatch]:
        """The global batch from ``first_sample`` on the device: the prefetched one if it is
        that batch, else read now."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == (first_sample, num_micro_batches):
            batches = pending[1].result()
        else:
            if pending is not None:
                pending[1].result()  # another batch (the caller changed course): wait, drop
            batches = self._host(first_sample, num_micro_batches)
        return [
            (t.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for t, y in batches
        ]

    def _drop(self) -> None:
        if self._pending is not None:
            self._pending[1].result()
            self._pending = None

    def close(self) -> None:
        """Wait for a read in flight and stop the worker."""
        self._drop()
        self._pool.shutdown(wait=True)
