"""Pipeline parallelism: activations over point-to-point links, GPipe, 1F1B, interleaved 1F1B.

The model's L layers are split into ``p`` stages (``L / p`` consecutive layers each); a batch is
split into ``m`` micro-batches. Stage ``s`` receives its input (b, T, H) from stage ``s-1``,
sends its output to ``s+1``, and in backward receives the output's gradient from ``s+1`` and
sends the input's gradient to ``s-1``. F_i / B_i are the forward / backward of micro-batch i::

    GPipe  stage 0: F0 F1 F2 F3 .. .. B0 B1 B2 B3     all forwards, then all backwards
    (p=2)  stage 1: .. F0 F1 F2 F3 B0 B1 B2 B3 ..     m activations alive per stage
    1F1B   stage 0: F0 F1 .. B0 F2 B1 F3 B2 .. B3     p - s - 1 warm-up forwards, then
    (p=2)  stage 1: .. F0 B0 F1 B1 F2 B2 F3 B3 ..     one forward, one backward;
                                                      at most p - s activations alive

(m = 4, one slot per F or B.) Both leave the same idle time (the bubble): here 2 of each stage's
10 slots, and in general a fraction ``(p-1)/(m+p-1)`` of the step when all F and all B take the
same time; 1F1B's gain is memory (``tests/test_gpt_pipeline_diagram.py`` replays both orders slot
by slot and compares them with these lines). Both compute the same gradients: each is
the sum over micro-batches of ``d(loss_i / m)``, accumulated in ``.grad``.

Interleaved 1F1B (``chunks = v > 1``, ``interleaved.py``): each rank holds v chunks
of ``L / (p v)`` layers and runs Megatron's interleaved order; bubble ``(p-1)/(v m + p - 1)``.

Communication: only the named steps of ``p2p_communication.py``, each one batch of point-to-point
operations. Gradient finalisation (tied embedding, data parallel, norm, clipping) follows the
schedule, in ``optimizer/clip_grads.py``; with ``--overlap-grad-reduce`` the data-parallel buckets
start during each chunk's last backward (``B3`` above), told by the back end's ``grad_sync``.

Tied embedding: the first stage holds E for the input, the last stage a copy for the logits;
both start equal (``gpt_model.init_parameters``) and stay equal (``gradients.reduce_gradients``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch

from distlab.gpt.interfaces import BackwardFn, GradSyncFn, mean_backward, no_grad_sync
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pipeline_parallel.interleaved import ChunkStep, run_interleaved
from distlab.gpt.pipeline_parallel.p2p_communication import (
    P2PSpec,
    recv_backward,
    recv_forward,
    send_backward,
    send_backward_recv_forward,
    send_forward,
    send_forward_recv_backward,
)
from distlab.gpt.pipeline_parallel.timeline import PipelineTimeline, theoretical_bubble

#: step(x, i): stage forward of micro-batch i. x is the received (b, T, H) activation (None on
#: the first stage, which reads micro-batch i itself); returns the (b, T, H) output, or on the
#: last stage the scalar loss of micro-batch i (a mean over its tokens).
StageStep = Callable[[torch.Tensor | None, int], torch.Tensor]

SCHEDULES = ("gpipe", "1f1b")


@dataclass
class _Stage:
    """This rank's stage during one step: what every schedule needs."""

    step: StageStep
    state: ParallelState
    spec: P2PSpec
    timeline: PipelineTimeline | None
    backward_fn: BackwardFn  # the back end's hook, on the last stage's loss: d(loss_i x S / m)
    grad_sync: GradSyncFn  # the back end's: True before this chunk's last backward of the step
    m: int
    is_last: bool  # the last (virtual) stage: its step returns the loss
    chunk: int = 0  # which of this rank's model chunks (interleaved schedule)
    losses: list[torch.Tensor] = field(default_factory=list)  # on the last stage

    def forward(self, x: torch.Tensor | None, i: int) -> torch.Tensor:
        """F_i: (b, T, H) out, or on the last stage the loss (its value also kept in losses)."""
        if x is not None:
            x.requires_grad_()
        with self.timeline.record("F", i, self.chunk) if self.timeline else nullcontext():
            y = self.step(x, i)
        if not self.is_last:
            return y
        if y.dim() != 0:
            raise ValueError(f"the last stage's step must return a scalar loss, got shape {tuple(y.shape)}")
        self.losses.append(y.detach())
        return y

    def backward(self, x: torch.Tensor | None, y: torch.Tensor, dy: torch.Tensor | None, i: int):
        """B_i: back-propagate dy (on the last stage, y is the loss: the back end's hook); return dx.
        B_{m-1}, the chunk's last, runs with gradient sync enabled, the others without."""
        self.grad_sync(i == self.m - 1)
        with self.timeline.record("B", i, self.chunk) if self.timeline else nullcontext():
            if self.is_last:
                self.backward_fn(y, i, self.m)
            else:
                torch.autograd.backward(y, grad_tensors=dy.to(y.dtype))  # dy travelled as spec.dtype
        return x.grad if x is not None else None


def run_gpipe(s: _Stage, m: int) -> None:
    """All m forwards, then all m backwards (in micro-batch order)."""
    saved = []
    for i in range(m):
        x = recv_forward(s.state, s.spec)
        y = s.forward(x, i)
        send_forward(y, s.state, s.spec)
        saved.append((x, y))
    for i in range(m):
        dy = recv_backward(s.state, s.spec)
        x, y = saved[i]
        send_backward(s.backward(x, y, dy, i), s.state, s.spec)
        saved[i] = None  # free micro-batch i's activations


def run_1f1b(s: _Stage, m: int) -> None:
    """Warm-up forwards, then one forward / one backward, then cool-down backwards."""
    state, spec = s.state, s.spec
    warmup = min(state.pp - state.pp_rank - 1, m)  # forwards in flight before the first backward
    steady = m - warmup
    saved: deque = deque()
    for i in range(warmup):
        x = recv_forward(state, spec)
        y = s.forward(x, i)
        send_forward(y, state, spec)
        saved.append((x, y))
    x = recv_forward(state, spec) if steady else None
    for j in range(steady):  # F_{w+j}, then B_j
        y = s.forward(x, warmup + j)
        dy = send_forward_recv_backward(y, state, spec)
        saved.append((x, y))
        dx = s.backward(*saved.popleft(), dy, j)
        if j < steady - 1:
            x = send_backward_recv_forward(dx, state, spec)
        else:
            send_backward(dx, state, spec)
    for i in range(steady, m):  # cool-down
        dy = recv_backward(state, spec)
        send_backward(s.backward(*saved.popleft(), dy, i), state, spec)


def _stages(step, state, spec, timeline, backward, grad_sync, m: int, chunks: int) -> list[_Stage]:
    """One runner per model chunk; the last stage's last chunk returns the loss."""
    if chunks == 1:
        return [_Stage(step, state, spec, timeline, backward, grad_sync, m, state.is_last_stage)]
    return [
        _Stage(partial(_chunk_step, step, c), state, spec, timeline, backward, grad_sync, m,
               state.is_last_stage and c == chunks - 1, chunk=c)
        for c in range(chunks)
    ]  # fmt: skip


def _chunk_step(step: ChunkStep, chunk: int, x: torch.Tensor | None, i: int) -> torch.Tensor:
    return step(x, i, chunk)


def forward_backward_pipeline(
    step: StageStep | ChunkStep,
    *,
    num_microbatches: int,
    state: ParallelState,
    spec: P2PSpec,
    schedule: str = "1f1b",
    timeline: PipelineTimeline | None = None,
    backward: BackwardFn = mean_backward,
    grad_sync: GradSyncFn = no_grad_sync,
    chunks: int = 1,
) -> list[torch.Tensor]:
    """Run one batch through this rank's stage; gradients accumulate in ``.grad``.

    On the last stage ``backward(loss_i, i, m)`` back-propagates each micro-batch's loss (the
    back end's hook: ``loss_i x S / m``, ``S`` fp16's scale); the other stages back-propagate
    the gradient they receive. Before every backward, ``grad_sync(i == m - 1)`` (Megatron's
    ``no_sync_func`` / ``enable_grad_sync``): only each chunk's last one may start the data-parallel
    reduction of its gradients (``--overlap-grad-reduce``); the back end finishes it after the
    schedule. ``chunks = v > 1``: interleaved 1F1B, ``step(x, i, chunk)``.
    Returns the m per-micro-batch losses (detached, unscaled) on the last stage, ``[]``
    elsewhere. Finalise the gradients afterwards (``clip_grads.finalize_gradients``).
    """
    check_schedule(schedule, chunks)
    m = num_microbatches
    if m < 1:
        raise ValueError(f"the pipeline needs >= 1 micro-batch per step, got {m}")
    if timeline is not None:
        timeline.start_step(schedule, m, chunks)
    stages = _stages(step, state, spec, timeline, backward, grad_sync, m, chunks)
    if chunks > 1:
        run_interleaved(stages, m)
    else:
        (run_gpipe if schedule == "gpipe" else run_1f1b)(stages[0], m)
    return stages[-1].losses


@torch.no_grad()
def forward_only_pipeline(
    step: StageStep | ChunkStep,
    *,
    num_microbatches: int,
    state: ParallelState,
    spec: P2PSpec,
    chunks: int = 1,
) -> list[torch.Tensor]:
    """Evaluation: forwards only, each sent on at once; the losses on the last stage."""
    if chunks > 1:
        stages = _stages(step, state, spec, None, mean_backward, no_grad_sync, num_microbatches, chunks)
        run_interleaved(stages, num_microbatches, forward_only=True)
        return stages[-1].losses
    losses: list[torch.Tensor] = []
    for i in range(num_microbatches):
        y = step(recv_forward(state, spec), i)
        if state.is_last_stage:
            losses.append(y.detach())
        send_forward(y, state, spec)
    return losses


def check_schedule(schedule: str, chunks: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"--pipeline-schedule {schedule!r} is unknown: choose one of {', '.join(SCHEDULES)}")
    if chunks > 1 and schedule != "1f1b":
        raise ValueError(
            f"--pipeline-schedule {schedule} with {chunks} virtual stages per rank: the interleaved "
            "schedule is a 1F1B, use --pipeline-schedule 1f1b"
        )


def describe(schedule: str, p: int, m: int, v: int = 1) -> str:
    """The start-up line of a pipelined run."""
    if v > 1:
        return (
            f"> pipeline schedule interleaved {schedule}: {p} stages x {v} chunks x {m} micro-batches "
            f"per step, theoretical bubble (p-1)/(vm+p-1) = {theoretical_bubble(p, m, v):.1%}"
        )
    return (
        f"> pipeline schedule {schedule}: {p} stages x {m} micro-batches per step, "
        f"theoretical bubble (p-1)/(m+p-1) = {theoretical_bubble(p, m):.1%}"
    )


@dataclass
class PipelineForwardBackward:
    """``training.forward_backward`` for pp > 1: the same call, run through GPipe, 1F1B or
    (``chunks > 1``) interleaved 1F1B.

    For a stage model with ``set_input_tensor(x)`` and ``forward(tokens, labels, chunk)``
    returning per-token losses (b, T) on the last virtual stage and hidden states (b, T, H)
    elsewhere. Returns the
    mean micro-batch loss on the last stage (zero elsewhere; ``training.reduce_loss``
    broadcasts it).
    """

    state: ParallelState
    spec: P2PSpec
    schedule: str = "1f1b"
    timeline: PipelineTimeline | None = None
    chunks: int = 1  # v, model chunks per rank

    def __post_init__(self) -> None:
        check_schedule(self.schedule, self.chunks)

    def _step(self, model, batches, autocast, x: torch.Tensor | None, i: int, chunk: int = 0) -> torch.Tensor:
        """Chunk forward of micro-batch i: a scalar loss on the last virtual stage, else (b, T, H)."""
        model.set_input_tensor(x)
        tokens, labels = batches[i]
        with autocast():
            out = model(tokens, labels, chunk=chunk)
        last = self.state.is_last_stage and chunk == self.chunks - 1
        return out.float().mean() if last else out

    def __call__(
        self,
        model: torch.nn.Module,
        batches: list,
        *,
        backward: BackwardFn = mean_backward,
        grad_sync: GradSyncFn = no_grad_sync,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
        forward_only: bool = False,
    ) -> torch.Tensor:
        step = partial(self._step, model, batches, autocast)
        kw = dict(num_microbatches=len(batches), state=self.state, spec=self.spec, chunks=self.chunks)
        if forward_only:
            losses = forward_only_pipeline(step, **kw)
        else:
            losses = forward_backward_pipeline(
                step,
                **kw,
                schedule=self.schedule,
                timeline=self.timeline,
                backward=backward,
                grad_sync=grad_sync,
            )
        model.set_input_tensor(None)
        if losses:
            return torch.stack(losses).float().mean()
        return torch.zeros((), dtype=torch.float32, device=self.spec.device)
