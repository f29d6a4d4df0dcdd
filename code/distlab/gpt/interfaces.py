"""The types every part of a training step shares: micro-batches, hooks, outcomes, back ends.

One step (``training.train_step``) is the same loop for every back end::

    backend.zero_grad()
    for k in range(m):  loss_k = model(micro-batch k);  backend.set_grad_sync(k == m - 1)
                        backend.backward(loss_k, k, m)
    loss = mean over micro-batches and data-parallel ranks
    backend.step()      # gradients reduced, unscaled, clipped; the optimizer steps (or skips)

A :class:`StepBackend` supplies only what differs: what the forward runs on, how backward is
called (and where gradients start being reduced), how the optimizer steps. This engine's own
(``training.LocalBackend``) and DeepSpeed's (``deepspeed_engine.DeepSpeedBackend``) are two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # tokens (b, T), labels (b, T)
AutocastFn = Callable[[], contextlib.AbstractContextManager]
#: backward(loss_k, k, m): back-propagate micro-batch k's mean loss as its 1/m share of the step.
BackwardFn = Callable[[torch.Tensor, int, int], None]
#: grad_sync(enabled), called by every schedule before each backward of a model chunk: True for
#: the backward of its last micro-batch (Megatron's ``enable_grad_sync``), when the data-parallel
#: reduction may start as the gradients become ready; False for the others, which only accumulate
#: (``disable_grad_sync``, the ``no_sync_func`` of Megatron's schedules). Pipeline stages other than
#: the last back-propagate a received gradient, not a loss: this, not ``BackwardFn``, tells them.
GradSyncFn = Callable[[bool], None]


def mean_backward(loss: torch.Tensor, k: int, m: int) -> None:
    """The plain hook: ``d(loss_k / m)`` accumulated in ``.grad``."""
    (loss * (1.0 / m)).backward()


def no_grad_sync(enabled: bool) -> None:
    """The plain schedule's ``GradSyncFn``: nothing reduces during backward."""


#: A step's scalar where it was computed: a 0-d device tensor (read on the host only once per
#: ``--log-interval``, ``training/log.py``) or a Python value a back end already had on the host.
DeviceScalar = torch.Tensor | float | bool


@dataclass
class StepOutcome:
    """What a back end's optimizer step found: the norm before clipping (None after an fp16
    overflow), whether the update was skipped, whether a gradient was inf or nan."""

    grad_norm: DeviceScalar | None
    skipped: DeviceScalar
    nonfinite: DeviceScalar = False


@dataclass
class StepResult:
    """What a step reports: mean loss over the global batch, norm (None after an fp16 overflow),
    still on the device (``DeviceScalar``): a step that does not log never waits for the device."""

    loss: DeviceScalar
    grad_norm: DeviceScalar | None
    skipped: DeviceScalar
    nan: DeviceScalar
    forward_backward_ms: float = 0.0  # this rank's own forward and backward (--log-straggler)


class StepBackend(Protocol):
    """What differs between ways of taking one optimizer step (see the module docstring)."""

    module: torch.nn.Module  # what the forward is called on

    def zero_grad(self) -> None: ...

    def set_grad_sync(self, enabled: bool) -> None: ...  # a GradSyncFn

    def backward(self, loss: torch.Tensor, k: int, m: int) -> None: ...

    def step(self) -> StepOutcome: ...

    def close(self) -> None: ...
