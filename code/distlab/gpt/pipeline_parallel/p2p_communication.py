"""Point-to-point communication of pipeline parallelism: named steps over one batched primitive.

Stage ``s`` receives its input x (b, T, H) from ``s - 1`` and sends its output y to ``s + 1``;
in backward it receives dy from ``s + 1`` and sends dx to ``s - 1``. The schedules
(``schedules.py``) call only these steps, the interleaved one (``interleaved.py``)
:func:`exchange` with its planned rounds; a stage without that neighbour does nothing and
receives ``None``::

    recv_forward()                   x  <- s - 1
    send_forward(y)                  y  -> s + 1
    recv_backward()                  dy <- s + 1
    send_backward(dx)                dx -> s - 1
    send_forward_recv_backward(y)    y  -> s + 1  and  dy <- s + 1     (1F1B steady state)
    send_backward_recv_forward(dx)   dx -> s - 1  and  x  <- s - 1     (1F1B steady state)

Why one batch (:func:`exchange`): in 1F1B's steady state stage ``s`` sends y to ``s + 1`` and
receives dy from it while ``s + 1`` sends dx to ``s`` and receives the next x from it. Posted one
by one as irecv-then-isend on both sides, NCCL runs a pair's operations in order on one stream:
each rank's receive waits for the other's send, queued behind the other's receive, forever.
``dist.batch_isend_irecv`` posts the list of ``dist.P2POp`` as one group (``ncclGroupStart/End``),
so both directions progress together. gloo would tolerate either order; the code is written as
NCCL needs it, and ``tests/test_gpt_pipeline.py`` checks the batches that are posted.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.gpt.parallel_state import ParallelState


@dataclass(frozen=True)
class P2PSpec:
    """What travels between stages: one (b, T, H) activation or gradient per micro-batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    timeout_s: float = 300.0


def _outgoing(tensor: torch.Tensor, state: ParallelState, spec: P2PSpec) -> torch.Tensor:
    """The tensor as it travels: ``spec.dtype`` (autocast may leave half precision), contiguous."""
    if tuple(tensor.shape) != tuple(spec.shape):
        raise ValueError(
            f"pipeline stage {state.pp_rank} sends shape {tuple(tensor.shape)} but the schedule "
            f"expects {tuple(spec.shape)} (micro-batch, sequence, hidden)"
        )
    return tensor.detach().to(spec.dtype).contiguous()


def exchange(
    state: ParallelState,
    spec: P2PSpec,
    sends: list[tuple[torch.Tensor, int]],
    recv_from: list[int],
) -> list[torch.Tensor]:
    """Post every isend (tensor, peer stage) and irecv (peer stage) of one step as ONE batch, wait.

    Returns the received tensors in the order of ``recv_from``.
    """
    received = [torch.empty(spec.shape, dtype=spec.dtype, device=spec.device) for _ in recv_from]
    ops = [
        dist.P2POp(dist.isend, _outgoing(t, state, spec), state.stage_rank(s), group=state.pp_group)
        for t, s in sends
    ]
    ops += [
        dist.P2POp(dist.irecv, buf, state.stage_rank(s), group=state.pp_group)
        for buf, s in zip(received, recv_from, strict=True)
    ]
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait(timeout=datetime.timedelta(seconds=spec.timeout_s))
    except RuntimeError as exc:  # gloo's flight recorder lists no point-to-point op: say which
        peers = [state.stage_rank(s) for _, s in sends] + [state.stage_rank(s) for s in recv_from]
        what = ", ".join([f"isend to rank {state.stage_rank(s)}" for _, s in sends] +
                         [f"irecv from rank {state.stage_rank(s)}" for s in recv_from])  # fmt: skip
        raise PipelineTransferError(
            f"{exc} (in the pipeline's {what}, shape {tuple(spec.shape)})", peers, what, spec.shape
        ) from exc
    return received


class PipelineTransferError(RuntimeError):
    """A batched pipeline transfer that failed (a timeout: a peer stage never posted its half);
    ``peers`` are the global ranks it exchanges with, ``what`` names the isends and irecvs."""

    def __init__(self, message: str, peers: list[int], what: str, shape: tuple[int, ...]) -> None:
        super().__init__(message)
        self.peers, self.what, self.shape = peers, what, tuple(shape)


def recv_forward(state: ParallelState, spec: P2PSpec) -> torch.Tensor | None:
    """x from the previous stage (None on the first stage, which reads tokens)."""
    if state.is_first_stage:
        return None
    return exchange(state, spec, [], [state.pp_rank - 1])[0]


def send_forward(y: torch.Tensor, state: ParallelState, spec: P2PSpec) -> None:
    """y to the next stage (nothing on the last stage, whose output is the loss)."""
    if not state.is_last_stage:
        exchange(state, spec, [(y, state.pp_rank + 1)], [])


def recv_backward(state: ParallelState, spec: P2PSpec) -> torch.Tensor | None:
    """dy from the next stage (None on the last stage: its output is the loss)."""
    if state.is_last_stage:
        return None
    return exchange(state, spec, [], [state.pp_rank + 1])[0]


def send_backward(dx: torch.Tensor | None, state: ParallelState, spec: P2PSpec) -> None:
    """dx to the previous stage (nothing on the first stage)."""
    if not state.is_first_stage:
        exchange(state, spec, [(dx, state.pp_rank - 1)], [])


def send_forward_recv_backward(y: torch.Tensor, state: ParallelState, spec: P2PSpec) -> torch.Tensor | None:
    """y to the next stage and dy from it, in one batch (None on the last stage)."""
    if state.is_last_stage:
        return None
    return exchange(state, spec, [(y, state.pp_rank + 1)], [state.pp_rank + 1])[0]


def send_backward_recv_forward(
    dx: torch.Tensor | None, state: ParallelState, spec: P2PSpec
) -> torch.Tensor | None:
    """dx to the previous stage and the next x from it, in one batch (None on the first stage)."""
    if state.is_first_stage:
        return None
    return exchange(state, spec, [(dx, state.pp_rank - 1)], [state.pp_rank - 1])[0]
