"""One training step and one evaluation, for a data-parallel group of model replicas.

A step consumes one global batch of ``G = m x dp x M`` samples (micro batch ``m``, accumulation
steps ``M``). Data-parallel rank ``r`` takes, for micro-step ``k``, the samples::

    consumed + k m dp + r m  ...  consumed + k m dp + (r + 1) m - 1

so the union over ranks and micro-steps is the same global batch for every layout. Each
micro-batch loss (mean over its ``m x s`` tokens) is back-propagated as ``loss_k x S / M`` (``S``
the fp16 loss scale, else 1); DDP averages over ``dp`` on the last micro-step only (``no_sync``
before), so the gradient is the gradient of the global batch's mean loss::

    g = (1 / dp) sum_r (1 / M) sum_k grad(loss_{r,k})

``forward_backward`` is the piece part 2 replaces by GPipe / 1F1B schedules when pp > 1.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.gpt_dataset import GPTDataset
from distlab.gpt.loss_scaler import DynamicLossScaler, unscale_and_check
from distlab.gpt.optimizer import clip_gradients, grad_norm
from distlab.gpt.parallel_state import ParallelState

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # tokens (m, s), labels (m, s)


def micro_batches(
    dataset: GPTDataset,
    consumed: int,
    *,
    micro_batch_size: int,
    num_micro_batches: int,
    dp: int,
    dp_rank: int,
    device: torch.device,
) -> list[MicroBatch]:
    """This rank's ``M`` micro-batches of the global batch starting at sample ``consumed``."""
    out = []
    for k in range(num_micro_batches):
        start = consumed + k * micro_batch_size * dp + dp_rank * micro_batch_size
        tokens, labels = dataset.batch(range(start, start + micro_batch_size))
        out.append((tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)))
    return out


def forward_backward(
    model: nn.Module,
    batches: list[MicroBatch],
    *,
    loss_scale: float = 1.0,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    forward_only: bool = False,
) -> torch.Tensor:
    """Forward (+ backward unless ``forward_only``) over the step's micro-batches.

    Returns the mean micro-batch loss, a detached fp32 scalar. Gradients accumulate in ``.grad``;
    with DDP they are all-reduced once, during the last micro-batch's backward.
    """
    total = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
    M = len(batches)
    for k, (tokens, labels) in enumerate(batches):
        sync = forward_only or k == M - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            with autocast():
                loss = model(tokens, labels).mean()  # per-token (m, s) -> scalar
            if not forward_only:
                (loss * (loss_scale / M)).backward()
        total += loss.detach().float()
    return total / M


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
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[MicroBatch],
    *,
    state: ParallelState,
    clip_grad: float,
    scaler: DynamicLossScaler | None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    forward_backward_fn: Callable[..., torch.Tensor] = forward_backward,
) -> StepResult:
    """Zero grads, forward/backward all micro-batches, unscale + overflow check (fp16), clip, step."""
    optimizer.zero_grad(set_to_none=True)
    scale = scaler.scale if scaler is not None else 1.0
    loss_t = forward_backward_fn(model, batches, loss_scale=scale, autocast=autocast)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    loss = reduce_loss(loss_t, state)
    nan = not math.isfinite(loss)
    if scaler is not None:
        found_inf = unscale_and_check(params, scale)
        scaler.update(found_inf)
        if found_inf:
            return StepResult(loss, None, skipped=True, nan=nan)
    norm = grad_norm(params, state)
    norm_f = float(norm)
    if not math.isfinite(norm_f):
        return StepResult(loss, norm_f, skipped=scaler is None, nan=True)
    clip_gradients(params, clip_grad, norm)
    optimizer.step()
    return StepResult(loss, norm_f, skipped=False, nan=nan)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: GPTDataset,
    first_sample: int,
    *,
    eval_iters: int,
    global_batch_size: int,
    micro_batch_size: int,
    num_micro_batches: int,
    state: ParallelState,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
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
            dp=state.dp,
            dp_rank=state.dp_rank,
            device=device,
        )
        losses.append(
            reduce_loss(forward_backward_fn(model, batches, autocast=autocast, forward_only=True), state)
        )
    model.train(was_training)
    return sum(losses) / max(1, len(losses))
