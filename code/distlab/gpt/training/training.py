"""One training step and one evaluation, for every (tp, pp, dp) layout and every back end.

A step consumes one global batch of ``B = b x dp x m`` samples (micro-batch size ``b``, ``m``
micro-batches per rank). Data-parallel rank ``r`` takes, for micro-batch ``k``, the samples::

    consumed + k b dp + r b  ...  consumed + k b dp + (r + 1) b - 1

so the union over ranks and micro-batches is the same global batch for every layout. With
context parallelism the ``cp`` ranks of a data-parallel rank read the same samples and keep
``T / cp`` tokens of each (``context_parallel.split_sequence``). Each
micro-batch loss (mean over its ``b x T`` tokens) is back-propagated as ``loss_k x S / m`` (``S``
the fp16 loss scale, else 1), gradients accumulate in ``.grad``, and ``distributed/gradients.py`` averages
them over ``dp x cp`` once, after the last backward, so the gradient is the gradient of the
global batch's mean loss (every cp rank's loss is the mean over its T / cp tokens, equally many)::

    g = (1 / (dp cp)) sum_r (1 / m) sum_k grad(loss_{r,k})

:func:`train_step` is the one step loop (``interfaces.py``); :class:`LocalBackend` is this
engine's own back end. :func:`forward_backward` runs the micro-batches one after the other
(pp = 1); ``pipeline_parallel.PipelineForwardBackward`` is the same call through GPipe or 1F1B.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from distlab.gpt.context_parallel.ring_attention import ring_of, split_sequence
from distlab.gpt.data.gpt_dataset import GPTDataset
from distlab.gpt.distributed.grad_buckets import GradBuckets, default_bucket_size
from distlab.gpt.interfaces import (
    AutocastFn,
    BackwardFn,
    GradSyncFn,
    MicroBatch,
    StepBackend,
    StepOutcome,
    StepResult,
    mean_backward,
    no_grad_sync,
)
from distlab.gpt.optimizer.clip_grads import finalize_gradients
from distlab.gpt.optimizer.distrib_optimizer import DistributedOptimizer
from distlab.gpt.optimizer.loss_scaler import DynamicLossScaler
from distlab.gpt.optimizer.optimizer import step_unless
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training.log import Timer
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.gpt.transformer.moe.moe_layer import set_aux_loss_scale


def micro_batches(
    dataset: GPTDataset,
    consumed: int,
    *,
    micro_batch_size: int,
    num_micro_batches: int,
    state: ParallelState,
    device: torch.device,
) -> list[MicroBatch]:
    """This rank's ``m`` micro-batches of the global batch starting at sample ``consumed``:
    tokens and labels (b, T), or (b, T / cp) with context parallelism."""
    b, dp = micro_batch_size, state.dp
    ring = ring_of(state)
    out = []
    for k in range(num_micro_batches):
        start = consumed + k * b * dp + state.dp_rank * b
        tokens, labels = dataset.batch(range(start, start + b))
        if ring is not None:
            tokens, labels = split_sequence(tokens, ring), split_sequence(labels, ring)
        out.append((tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)))
    return out


def forward_backward(
    model: torch.nn.Module,
    batches: list[MicroBatch],
    *,
    backward: BackwardFn = mean_backward,
    grad_sync: GradSyncFn = no_grad_sync,
    autocast: AutocastFn = contextlib.nullcontext,
    forward_only: bool = False,
) -> torch.Tensor:
    """Forward (+ ``grad_sync(k == m - 1)``, ``backward(loss_k, k, m)`` unless ``forward_only``)
    over the step's micro-batches (pp = 1). Returns the mean micro-batch loss, a detached fp32 scalar."""
    total = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
    m = len(batches)
    for k, (tokens, labels) in enumerate(batches):
        with autocast():
            loss = model(tokens, labels).mean()  # per-token (b, T) -> scalar
        if not forward_only:
            grad_sync(k == m - 1)  # only the last backward's gradients start the dp reduction
            backward(loss, k, m)
        total += loss.detach().float()
    return total / m


def reduce_loss(loss: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Mean over the data- and context-parallel group, on every rank of the pipeline (from its
    last stage): a 0-d tensor on the device, not read here."""
    if state.dp * state.cp > 1:
        dist.all_reduce(loss, group=state.dp_cp_group)
        loss = loss / (state.dp * state.cp)
    if state.pp > 1:
        dist.broadcast(loss, src=state.stage_rank(state.pp - 1), group=state.pp_group)
    return loss


class LocalBackend:
    """This engine's own step: plain backward of ``loss_k x S / m``, then ``optimizer/clip_grads.py``'s
    finalisation (tied embedding, dp all-reduce, fp16 unscale, norm, clip) and the optimizer.

    The dp all-reduce runs in ``grad_buckets`` (default: one bucket, after backward); with
    ``overlap_grad_reduce`` each bucket starts during the last micro-batch's backward (of each
    model chunk: the schedules call :meth:`set_grad_sync` before every backward). The step is
    skipped after an fp16 overflow (the scaler backs off: the one read of the device in an fp16
    step) or a non-finite norm (decided on the device: ``optimizer.step_unless``).
    """

    def __init__(
        self,
        model: GPTModel,
        optimizer: torch.optim.Optimizer,
        state: ParallelState,
        *,
        clip_grad: float,
        scaler: DynamicLossScaler | None = None,
        overlap_grad_reduce: bool = False,
        bucket_size: int | None = None,  # elements, --ddp-bucket-size (default Megatron's)
        reduce_dtype: torch.dtype | None = None,  # --grad-reduce-in-bf16: the buckets' all-reduce dtype
    ) -> None:
        self.module, self.optimizer, self.state = model, optimizer, state
        self.clip_grad, self.scaler = clip_grad, scaler
        size = bucket_size if bucket_size is not None else default_bucket_size(state.dp * state.cp)
        self.grad_buckets = (
            optimizer.buffer  # --use-distributed-optimizer: reduce-scatters in its own buckets
            if isinstance(optimizer, DistributedOptimizer)
            else GradBuckets(
                list(model.parameters()),
                state,
                bucket_size=size,
                overlap=overlap_grad_reduce,
                reduce_dtype=reduce_dtype,
                hold=model.tied_embedding() if state.embedding_group is not None else None,
            )
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_grad_sync(self, enabled: bool) -> None:
        """The next backward is its chunk's last micro-batch's: the buckets' hooks start their reductions."""
        self.grad_buckets.last_micro_batch = enabled

    def backward(self, loss: torch.Tensor, k: int, m: int) -> None:
        scale = self.scaler.scale if self.scaler is not None else 1.0
        (loss * (scale / m)).backward()

    def step(self) -> StepOutcome:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        scale = self.scaler.scale if self.scaler is not None else None
        tied = self.module.tied_embedding()
        if isinstance(self.optimizer, DistributedOptimizer):  # on this rank's shards
            grads = self.optimizer.finalize_gradients(tied, loss_scale=scale, clip_grad=self.clip_grad)
        else:
            grads = finalize_gradients(
                params,
                tied,
                self.state,
                loss_scale=scale,
                clip_grad=self.clip_grad,
                buckets=self.grad_buckets,
            )
        if self.scaler is not None:
            self.scaler.update(grads.overflow)
        if grads.overflow:
            return StepOutcome(None, skipped=True)
        # a norm that is not finite (a gradient inf or nan, or fp32's sum of squares overflowed):
        # no update, with or without a scaler, and the step says so
        nonfinite = ~torch.isfinite(grads.norm)  # 0-d bool, on the device
        step_unless(self.optimizer, nonfinite)
        return StepOutcome(grads.norm, skipped=nonfinite, nonfinite=nonfinite)

    def close(self) -> None:
        if isinstance(self.optimizer, DistributedOptimizer):  # no all-gather left in flight
            self.optimizer.buffer.finish_param_sync()


def train_step(
    backend: StepBackend,
    batches: list[MicroBatch],
    *,
    state: ParallelState,
    autocast: AutocastFn = contextlib.nullcontext,
    forward_backward_fn: Callable[..., torch.Tensor] = forward_backward,
    time_forward_backward: bool = False,
) -> StepResult:
    """The one step loop: zero grads, forward/backward every micro-batch through the back end's
    hook, the mean loss over the data-parallel ranks, the back end's optimizer step. Without
    ``--fp16`` nothing is read from the device (the result's scalars stay there); with
    ``time_forward_backward`` (--log-straggler) the forward/backward's own time is measured, which
    waits for the device (CUDA) at its start and its end. The MoE
    layers' aux losses get the lm loss's backward factor ``S / m`` (Megatron's
    ``MoEAuxLossAutoScaler.set_loss_scale`` in its forward step)."""
    backend.zero_grad()
    scaler = getattr(backend, "scaler", None)  # LocalBackend's (fp16); other back ends have no MoE
    set_aux_loss_scale(backend.module, (scaler.scale if scaler is not None else 1.0) / len(batches))
    timer = Timer(batches[0][0].device) if time_forward_backward else None
    loss = forward_backward_fn(
        backend.module, batches, backward=backend.backward, grad_sync=backend.set_grad_sync, autocast=autocast
    )
    # before the loss and gradient reductions wait for others
    forward_backward_ms = 1000 * timer.lap() if timer is not None else 0.0
    loss = reduce_loss(loss, state)
    outcome = backend.step()
    nan = ~torch.isfinite(loss) | outcome.nonfinite  # on the device: nothing read here
    return StepResult(
        loss, outcome.grad_norm, skipped=outcome.skipped, nan=nan, forward_backward_ms=forward_backward_ms
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
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
    return float(torch.stack(losses).mean()) if losses else 0.0  # read once per evaluation
