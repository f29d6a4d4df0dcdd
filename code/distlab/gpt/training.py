"""One training step and one evaluation, for every (tp, pp, dp) layout.

A step consumes one global batch of ``B = b x dp x m`` samples (micro-batch size ``b``, ``m``
micro-batches per rank). Data-parallel rank ``r`` takes, for micro-batch ``k``, the samples::

    consumed + k b dp + r b  ...  consumed + k b dp + (r + 1) b - 1

so the union over ranks and micro-batches is the same global batch for every layout. Each
micro-batch loss (mean over its ``b x T`` tokens) is back-propagated as ``loss_k x S / m`` (``S``
the fp16 loss scale, else 1), gradients accumulate in ``.grad``, and ``gradients.py`` averages
them over ``dp`` once, after the last backward, so the gradient is the gradient of the global
batch's mean loss::

    g = (1 / dp) sum_r (1 / m) sum_k grad(loss_{r,k})

:func:`forward_backward` runs the micro-batches one after the other (pp = 1);
``pipeline_parallel.PipelineForwardBackward`` is the same call through GPipe or 1F1B (pp > 1).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.gpt.gpt_dataset import GPTDataset
from distlab.gpt.gradients import finalize_gradients
from distlab.gpt.loss_scaler import DynamicLossScaler
from distlab.gpt.model import GPTModel
from distlab.gpt.parallel_state import ParallelState

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # tokens (b, T), labels (b, T)
AutocastFn = Callable[[], contextlib.AbstractContextManager]


def micro_batches(
    dataset: GPTDataset,
    consumed: int,
    *,
    micro_batch_size: int,
    num_micro_batches: int,
    state: ParallelState,
    device: torch.device,
) -> list[MicroBatch]:
    """This rank's ``m`` micro-batches of the global batch starting at sample ``consumed``."""
    b, dp = micro_batch_size, state.dp
    out = []
    for k in range(num_micro_batches):
        start = consumed + k * b * dp + state.dp_rank * b
        tokens, labels = dataset.batch(range(start, start + b))
        out.append((tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)))
    return out


def forward_backward(
    model: GPTModel,
    batches: list[MicroBatch],
    *,
    loss_scale: float = 1.0,
    autocast: AutocastFn = contextlib.nullcontext,
    forward_only: bool = False,
) -> torch.Tensor:
    """Forward (+ backward unless ``forward_only``) over the step's micro-batches (pp = 1).

    Returns the mean micro-batch loss, a detached fp32 scalar; gradients accumulate in ``.grad``.
    """
    total = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
    m = len(batches)
    for tokens, labels in batches:
        with autocast():
            loss = model(tokens, labels).mean()  # per-token (b, T) -> scalar
        if not forward_only:
            (loss * (loss_scale / m)).backward()
        total += loss.detach().float()
    return total / m


@dataclass
class StepResult:
    """What a step reports: mean loss over the global batch, norm (None if skipped)."""

    loss: float
    grad_norm: float | None
    skipped: bool
    nan: bool


def reduce_loss(loss: torch.Tensor, state: ParallelState) -> float:
    """Mean over the data-parallel group, on every rank of the pipeline (from its last stage)."""
    if state.dp > 1:
        dist.all_reduce(loss, group=state.dp_group)
        loss = loss / state.dp
    if state.pp > 1:
        dist.broadcast(loss, src=state.stage_rank(state.pp - 1), group=state.pp_group)
    return float(loss)


def train_step(
    model: GPTModel,
    optimizer: torch.optim.Optimizer,
    batches: list[MicroBatch],
    *,
    state: ParallelState,
    clip_grad: float,
    scaler: DynamicLossScaler | None,
    autocast: AutocastFn = contextlib.nullcontext,
    forward_backward_fn: Callable[..., torch.Tensor] = forward_backward,
) -> StepResult:
    """Zero grads, forward/backward every micro-batch, finalise the gradients, step.

    The step is skipped after an fp16 overflow (the scaler backs off) or a non-finite norm.
    """
    optimizer.zero_grad(set_to_none=True)
    scale = scaler.scale if scaler is not None else None
    loss = reduce_loss(forward_backward_fn(model, batches, loss_scale=scale or 1.0, autocast=autocast), state)
    nan = not math.isfinite(loss)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = finalize_gradients(params, model.tied_embedding(), state, loss_scale=scale, clip_grad=clip_grad)
    if scaler is not None:
        scaler.update(grads.overflow)
    if grads.overflow:
        return StepResult(loss, None, skipped=True, nan=nan)
    if not math.isfinite(grads.norm):
        return StepResult(loss, grads.norm, skipped=scaler is None, nan=True)
    optimizer.step()
    return StepResult(loss, grads.norm, skipped=False, nan=nan)


@torch.no_grad()
def evaluate(
    model: GPTModel,
    dataset: GPTDataset,
    first_sample: int,
    *,
    eval_iters: int,
    global_batch_size: int,
    micro_batch_size: int,
    num_micro_batches: int,
    state: ParallelState,
    device: torch.device,
    autocast: AutocastFn = contextlib.nullcontext,
    forward_backward_fn: Callable[..., torch.Tensor] = forward_backward,
) -> float:
    """Mean loss over ``eval_iters`` global batches from sample ``first_sample`` of ``dataset``."""
    was_training = model.training
    model.eval()
    losses = []
    for i in range(eval_iters):
        batches = micro_batches(
            dataset,
            first_sample + i * global_batch_size,
            micro_batch_size=micro_batch_size,
            num_micro_batches=num_micro_batches,
            state=state,
            device=device,
        )
        loss = forward_backward_fn(model, batches, autocast=autocast, forward_only=True)
        losses.append(reduce_loss(loss, state))
    model.train(was_training)
    return sum(losses) / max(1, len(losses))
