"""Pipeline parallelism: activations over point-to-point links, GPipe and 1F1B schedules.

The model's L layers are split into ``p`` stages (``L / p`` consecutive layers each); a batch is
split into ``m`` micro-batches. Stage ``s`` receives its input (B, T, H) from stage ``s-1``,
sends its output to ``s+1``, and in backward receives the output's gradient from ``s+1`` and
sends the input's gradient to ``s-1``. F_i / B_i are the forward / backward of micro-batch i::

    GPipe  stage 0: F0 F1 F2 F3 .. .. .. .. .. .. B0 B1 B2 B3     all forwards, then all backwards
    (p=2)  stage 1: .. F0 F1 F2 F3 B0 B1 B2 B3 .. .. .. .. ..     m activations alive per stage
    1F1B   stage 0: F0 F1 .. B0 F2 B1 F3 B2 .. B3                 p - s - 1 warm-up forwards, then
    (p=2)  stage 1: .. F0 B0 F1 B1 F2 B2 F3 B3                    one forward, one backward
                                                                  at most p - s activations alive

Both leave the same idle time (the bubble), a fraction ``(p-1)/(m+p-1)`` of the step when all
F and all B take the same time; 1F1B's gain is memory. Both compute the same gradients: each is
the sum over micro-batches of ``d(loss_i / m)``, accumulated in ``.grad``.

Data parallelism with ``pp > 1`` (why not plain DDP): DDP all-reduces a gradient bucket from an
autograd hook during the backward that follows a *synchronising* forward, and ``no_sync()`` is
how gradient accumulation skips that. In 1F1B the forwards and backwards of different
micro-batches interleave (stage 0 runs F3 before B1 and B2), so no single forward can be marked
"the last one" without DDP reducing during the backward of an *earlier* micro-batch and then
seeing the same parameters become ready again. So the whole schedule runs under ``no_sync()``
(gradients accumulate locally) and :func:`finalize_gradients` then averages the accumulated
gradients over ``state.dp_group`` with one flat all-reduce, after the last backward, as
Megatron's ``finalize_model_grads`` does. The price is losing DDP's overlap of that all-reduce
with the backward; the result is exactly DDP's average.

Tied embedding: the first stage holds E for the input, the last stage a copy for the logits.
Both copies start equal (``pp_communications.sync_tied_embedding_``) and their gradients are summed over
``state.embedding_group`` before the optimizer step, so they stay equal.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from .parallel_state import ParallelState
from .pipeline_timeline import PipelineTimeline, theoretical_bubble
from .pp_communications import P2PSpec, communicate, finalize_gradients

#: step(x, i): stage forward of micro-batch i. x is the received (B, T, H) activation (None on
#: the first stage, which reads micro-batch i itself); returns the (B, T, H) output, or on the
#: last stage the scalar loss of micro-batch i (a mean over its tokens).
StageStep = Callable[[torch.Tensor | None, int], torch.Tensor]

SCHEDULES = ("gpipe", "1f1b")


def _forward(
    step: StageStep,
    x: torch.Tensor | None,
    i: int,
    scale: float,
    losses: list[torch.Tensor],
    state: ParallelState,
    timeline: PipelineTimeline | None,
) -> torch.Tensor:
    if x is not None:
        x.requires_grad_()
    with timeline.record("F", i) if timeline else nullcontext():
        y = step(x, i)
    if state.is_last_stage:
        if y.dim() != 0:
            raise ValueError(f"the last stage's step must return a scalar loss, got shape {tuple(y.shape)}")
        losses.append(y.detach())
        y = y * scale  # loss_scale / m: the batch loss is the mean over micro-batches
    return y


def _backward(
    x: torch.Tensor | None,
    y: torch.Tensor,
    dy: torch.Tensor | None,
    i: int,
    timeline: PipelineTimeline | None,
) -> torch.Tensor | None:
    with timeline.record("B", i) if timeline else nullcontext():
        dy = dy.to(y.dtype) if dy is not None else None  # travelled as spec.dtype
        torch.autograd.backward(y, grad_tensors=dy)  # dy None: y is the last stage's loss
    return x.grad if x is not None else None


def run_gpipe(
    step: StageStep,
    m: int,
    state: ParallelState,
    spec: P2PSpec,
    timeline: PipelineTimeline | None = None,
    loss_scale: float = 1.0,
) -> list[torch.Tensor]:
    """All m forwards, then all m backwards (in micro-batch order); losses on the last stage."""
    scale = loss_scale / m
    losses: list[torch.Tensor] = []
    saved = []
    for i in range(m):
        x, _ = communicate(state, spec, recv_prev=True)
        y = _forward(step, x, i, scale, losses, state, timeline)
        communicate(state, spec, send_next=y)
        saved.append((x, y))
    for i in range(m):
        _, dy = communicate(state, spec, recv_next=True)
        x, y = saved[i]
        dx = _backward(x, y, dy, i, timeline)
        communicate(state, spec, send_prev=dx)
        saved[i] = None  # free micro-batch i's activations
    return losses


def run_1f1b(
    step: StageStep,
    m: int,
    state: ParallelState,
    spec: P2PSpec,
    timeline: PipelineTimeline | None = None,
    loss_scale: float = 1.0,
) -> list[torch.Tensor]:
    """Warm-up forwards, then one forward / one backward, then cool-down backwards."""
    warmup = min(state.pp - state.pp_rank - 1, m)  # forwards in flight before the first backward
    steady = m - warmup
    scale = loss_scale / m
    losses: list[torch.Tensor] = []
    saved: deque = deque()
    for i in range(warmup):
        x, _ = communicate(state, spec, recv_prev=True)
        y = _forward(step, x, i, scale, losses, state, timeline)
        communicate(state, spec, send_next=y)
        saved.append((x, y))
    x = communicate(state, spec, recv_prev=True)[0] if steady else None
    for j in range(steady):
        y = _forward(step, x, warmup + j, scale, losses, state, timeline)
        _, dy = communicate(state, spec, send_next=y, recv_next=True)  # F_{w+j} out, dB_j in
        saved.append((x, y))
        x_b, y_b = saved.popleft()
        dx = _backward(x_b, y_b, dy, j, timeline)
        last = j == steady - 1
        x, _ = communicate(state, spec, send_prev=dx, recv_prev=not last)
    for i in range(steady, m):
        _, dy = communicate(state, spec, recv_next=True)
        x_b, y_b = saved.popleft()
        dx = _backward(x_b, y_b, dy, i, timeline)
        communicate(state, spec, send_prev=dx)
    return losses


def forward_backward_pipeline(
    step: StageStep,
    *,
    num_microbatches: int,
    state: ParallelState,
    spec: P2PSpec,
    schedule: str = "1f1b",
    timeline: PipelineTimeline | None = None,
    no_sync: Callable[[], AbstractContextManager] | None = None,
    loss_scale: float = 1.0,
) -> list[torch.Tensor]:
    """Run one batch through this rank's stage; gradients accumulate in ``.grad``.

    Back-propagates ``loss_i x loss_scale / m`` per micro-batch (``loss_scale``: fp16's scale).
    Returns the m per-micro-batch losses (detached, unscaled) on the last stage, ``[]``
    elsewhere. ``no_sync`` is DDP's ``model.no_sync`` (see the module docstring); call
    :func:`finalize_gradients` afterwards.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule {schedule!r} is unknown: choose one of {', '.join(SCHEDULES)}")
    if num_microbatches < 1:
        raise ValueError(f"the pipeline needs >= 1 micro-batch per step, got {num_microbatches}")
    run = run_gpipe if schedule == "gpipe" else run_1f1b
    if timeline is not None:
        timeline.start_step(schedule, num_microbatches)
    with no_sync() if no_sync is not None else nullcontext():
        return run(step, num_microbatches, state, spec, timeline, loss_scale)


@torch.no_grad()
def forward_only_pipeline(
    step: StageStep, *, num_microbatches: int, state: ParallelState, spec: P2PSpec
) -> list[torch.Tensor]:
    """Evaluation: forwards only, each sent on at once; the losses on the last stage."""
    losses: list[torch.Tensor] = []
    for i in range(num_microbatches):
        x, _ = communicate(state, spec, recv_prev=True)
        y = step(x, i)
        if state.is_last_stage:
            losses.append(y.detach())
        communicate(state, spec, send_next=y)
    return losses


def describe(schedule: str, p: int, m: int) -> str:
    """The start-up line of a pipelined run."""
    return (
        f"> pipeline schedule {schedule}: {p} stages x {m} micro-batches per step, "
        f"theoretical bubble (p-1)/(m+p-1) = {theoretical_bubble(p, m):.1%}"
    )


def make_forward_backward(
    state: ParallelState, spec: P2PSpec, *, schedule: str = "1f1b", timeline: PipelineTimeline | None = None
) -> Callable[..., torch.Tensor]:
    """A drop-in for ``training.forward_backward`` when pp > 1, for a stage model with
    ``set_input_tensor(x)``, ``output_embedding()`` and ``forward(tokens, labels)`` returning
    per-token losses (B, T) on the last stage and hidden states (B, T, H) elsewhere.

    The returned function takes (model, batches, *, loss_scale, autocast, forward_only), runs the
    schedule, then :func:`finalize_gradients` (tied embedding, then data parallel: ``model`` may
    be DDP, whose reduction is switched off by ``no_sync``), and returns the mean micro-batch
    loss on the last stage (zero elsewhere; ``training.reduce_loss`` broadcasts it).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule {schedule!r} is unknown: choose one of {', '.join(SCHEDULES)}")

    def forward_backward(
        model: torch.nn.Module,
        batches: list,
        *,
        loss_scale: float = 1.0,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
        forward_only: bool = False,
    ) -> torch.Tensor:
        module = getattr(model, "module", model)  # under DDP

        def step(x: torch.Tensor | None, i: int) -> torch.Tensor:
            module.set_input_tensor(x)
            tokens, labels = batches[i]
            with autocast():
                out = model(tokens, labels)
            return out.float().mean() if state.is_last_stage else out  # (B, T) loss or (B, T, H)

        m = len(batches)
        if forward_only:
            losses = forward_only_pipeline(step, num_microbatches=m, state=state, spec=spec)
        else:
            losses = forward_backward_pipeline(
                step,
                num_microbatches=m,
                state=state,
                spec=spec,
                schedule=schedule,
                timeline=timeline,
                loss_scale=loss_scale,
                no_sync=getattr(model, "no_sync", None),
            )
            tied = module.output_embedding() if state.is_first_stage or state.is_last_stage else None
            finalize_gradients(list(module.parameters()), tied, state)
        module.set_input_tensor(None)
        if losses:
            return torch.stack(losses).float().mean()
        return torch.zeros((), dtype=torch.float32, device=spec.device)

    return forward_backward
