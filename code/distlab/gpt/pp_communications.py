"""Communication of pipeline parallelism: activations between stages, and gradient finalisation.

* :func:`communicate`: one stage's sends and receives of a step, posted together, with a timeout.
* The tied embedding ``E`` lives on the first stage (input) and the last stage (logits):
  :func:`sync_tied_embedding_` makes both copies equal once, :func:`allreduce_tied_embedding_grad`
  sums ``dE = dE_first + dE_last`` on both, so they stay equal.
* :func:`allreduce_data_parallel_grads` averages the accumulated gradients over ``dp_group`` with
  one flat all-reduce (what DDP would do, after the whole schedule; see ``pipeline_parallel``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .parallel_state import ParallelState


@dataclass(frozen=True)
class P2PSpec:
    """What travels between stages: one (B, T, H) activation or gradient per micro-batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    timeout_s: float = 300.0


def communicate(
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
