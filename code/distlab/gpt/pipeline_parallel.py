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
Both copies start equal (:func:`sync_tied_embedding_`) and their gradients are summed over
``state.embedding_group`` before the optimizer step, so they stay equal.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .parallel_state import ParallelState
from .pipeline_timeline import PipelineTimeline, theoretical_bubble

#: step(x, i): stage forward of micro-batch i. x is the received (B, T, H) activation (None on
#: the first stage, which reads micro-batch i itself); returns the (B, T, H) output, or on the
#: last stage the scalar loss of micro-batch i (a mean over its tokens).
StageStep = Callable[[torch.Tensor | None, int], torch.Tensor]

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class P2PSpec:
    """What travels between stages: one (B, T, H) activation or gradient per micro-batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    timeout_s: float = 300.0


def _communicate(
    state: ParallelState,
    spec: P2PSpec,
    *,
    send_next: torch.Tensor | None = None,
    send_prev: torch.Tensor | None = None,
    recv_prev: bool = False,
    recv_next: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Post every send and receive at once (so neighbours never wait on each other), then wait.

    Returns (tensor from the previous stage, tensor from the next stage). Peers are global ranks
    of this rank's pipeline group; a stage without that neighbour skips the operation.
    """
    ops: list[tuple[Callable, torch.Tensor, int]] = []
    from_prev = from_next = None
    if recv_prev and not state.is_first_stage:
        from_prev = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
        ops.append((dist.irecv, from_prev, state.stage_rank(state.pp_rank - 1)))
    if recv_next and not state.is_last_stage:
        from_next = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
        ops.append((dist.irecv, from_next, state.stage_rank(state.pp_rank + 1)))
    for tensor, peer_stage, ok in (
        (send_next, state.pp_rank + 1, not state.is_last_stage),
        (send_prev, state.pp_rank - 1, not state.is_first_stage),
    ):
        if tensor is not None and ok:
            tensor = tensor.to(spec.dtype)  # autocast may leave a half-precision activation
            if tuple(tensor.shape) != tuple(spec.shape):
                raise ValueError(
                    f"pipeline stage {state.pp_rank} sends shape {tuple(tensor.shape)} but "
                    f"the schedule expects {tuple(spec.shape)} (micro-batch, sequence, hidden)"
                )
            ops.append((dist.isend, tensor.detach().contiguous(), state.stage_rank(peer_stage)))
    works = [op(t, peer, group=state.pp_group) for op, t, peer in ops]
    for w in works:
        w.wait(timeout=datetime.timedelta(seconds=spec.timeout_s))
    return from_prev, from_next


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
        x, _ = _communicate(state, spec, recv_prev=True)
        y = _forward(step, x, i, scale, losses, state, timeline)
        _communicate(state, spec, send_next=y)
        saved.append((x, y))
    for i in range(m):
        _, dy = _communicate(state, spec, recv_next=True)
        x, y = saved[i]
        dx = _backward(x, y, dy, i, timeline)
        _communicate(state, spec, send_prev=dx)
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
        x, _ = _communicate(state, spec, recv_prev=True)
        y = _forward(step, x, i, scale, losses, state, timeline)
        _communicate(state, spec, send_next=y)
        saved.append((x, y))
    x = _communicate(state, spec, recv_prev=True)[0] if steady else None
    for j in range(steady):
        y = _forward(step, x, warmup + j, scale, losses, state, timeline)
        _, dy = _communicate(state, spec, send_next=y, recv_next=True)  # F_{w+j} out, dB_j in
        saved.append((x, y))
        x_b, y_b = saved.popleft()
        dx = _backward(x_b, y_b, dy, j, timeline)
        last = j == steady - 1
        x, _ = _communicate(state, spec, send_prev=dx, recv_prev=not last)
    for i in range(steady, m):
        _, dy = _communicate(state, spec, recv_next=True)
        x_b, y_b = saved.popleft()
        dx = _backward(x_b, y_b, dy, i, timeline)
        _communicate(state, spec, send_prev=dx)
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
        x, _ = _communicate(state, spec, recv_prev=True)
        y = step(x, i)
        if state.is_last_stage:
            losses.append(y.detach())
        _communicate(state, spec, send_next=y)
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


@torch.no_grad()
def sync_tied_embedding_(weight: torch.Tensor | None, state: ParallelState) -> None:
    """Copy the first stage's E onto the last stage's copy (call once, after initialisation)."""
    if state.pp == 1 or state.embedding_group is None:
        return
    if weight is None:
        raise ValueError(f"stage {state.pp_rank} is in the embedding group but passed no embedding weight")
    dist.broadcast(weight, src=state.stage_rank(0), group=state.embedding_group)


@torch.no_grad()
def allreduce_tied_embedding_grad(weight: torch.Tensor | None, state: ParallelState) -> None:
    """dE = dE_first + dE_last on both the first and the last stage (E is one parameter, used twice)."""
    if state.pp == 1 or state.embedding_group is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=state.embedding_group)


@torch.no_grad()
def allreduce_data_parallel_grads(params: Iterable[torch.nn.Parameter], state: ParallelState) -> None:
    """grad = mean over the dp replicas of grad: one flat all-reduce over ``state.dp_group``."""
    if state.dp == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=state.dp_group)
    flat /= state.dp
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def finalize_gradients(
    params: Iterable[torch.nn.Parameter],
    tied_weight: torch.Tensor | None,
    state: ParallelState,
    *,
    data_parallel: bool = True,
) -> None:
    """After the schedule: sum the tied embedding's two gradients, then average over dp.

    Pass ``data_parallel=False`` when DDP already averaged (pp == 1, synchronising backward).
    """
    allreduce_tied_embedding_grad(tied_weight, state)
    if data_parallel:
        allreduce_data_parallel_grads(params, state)
