"""Gradient norm and clipping, and the whole finalisation of a step's gradients (Megatron Core's
``optimizer/clip_grads.py``; its optimizers unscale, measure and clip in their ``step``).

After ``distributed/gradients.py``'s steps 1 to 3 (tied embedding, dp x cp average, the
sequence-parallel sum over tp) each rank holds the averaged gradients; then, in this order:

4. fp16: divide by ``S`` and look for inf / nan on any rank (the step is then skipped);
5. global norm ``||g|| = sqrt(sum_p ||g_p||^2)`` over the model-parallel ranks, each parameter
   counted once (a replicated one on tp rank 0, E's copy on the last stage not at all, each
   expert on the ep rank that holds it);
6. clipping: every gradient times ``min(1, clip / ||g||)`` (times 1 when ``||g||`` is not
   finite: the step is then skipped).

Nothing here reads the device but fp16's overflow check (step 4): the norm stays a device
tensor, and clipping multiplies by a device coefficient.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.distributed.grad_buckets import GradBuckets, is_expert
from distlab.gpt.distributed.gradients import reduce_gradients
from distlab.gpt.optimizer.loss_scaler import unscale_and_check
from distlab.gpt.parallel_state import ParallelState


def grad_norm(params: Iterable[nn.Parameter], state: ParallelState | None) -> torch.Tensor:
    """Step 5: global L2 norm of the gradients (fp32 scalar), counted once per distinct parameter."""
    tp_rank = state.tp_rank if state is not None else 0
    pp = state.pp if state is not None else 1
    ep = state.ep if state is not None else 1
    grads, experts = [], []
    for p in params:
        if p.grad is None or not counted_in_norm(p, tp_rank, pp):
            continue
        (experts if ep > 1 and is_expert(p) else grads).append(p.grad.detach())
    total = square_sum(grads)  # sum_p ||g_p||^2
    if ep > 1:  # each ep rank holds different experts: their squares add up over the group
        expert_total = square_sum(experts)
        dist.all_reduce(expert_total, group=state.ep_group)
        total = total + expert_total
    if state is not None:
        for group, size in ((state.tp_group, state.tp), (state.pp_group, state.pp)):
            if size > 1:
                dist.all_reduce(total, group=group)
    return total.sqrt()


def counted_in_norm(p: nn.Parameter, tp_rank: int, pp: int) -> bool:
    """Whether this rank counts ``p`` in the global norm: a replicated parameter on tp rank 0 only,
    the tied embedding's copy on the last stage never."""
    if getattr(p, "partition_dim", None) is None and tp_rank != 0:
        return False
    return not (getattr(p, "shared_embedding", False) and pp > 1)


def square_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=collective_device())
    return torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()


def collective_device() -> torch.device:
    """Where collectives of this rank's groups run: its GPU with nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def clip_gradients(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Step 6: scale all gradients by ``min(1, max_norm / norm)`` (no-op when ``max_norm`` is 0),
    computed on the device; by 1 when ``norm`` is inf or nan (they stay as they were)."""
    if max_norm <= 0:
        return
    coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    coeff = torch.where(torch.isfinite(norm), coeff, torch.ones_like(coeff))
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coeff.to(grads[0].device))


@dataclass
class Gradients:
    """What finalisation found: the norm before clipping, a 0-d fp32 tensor on the device (None
    after an fp16 overflow)."""

    norm: torch.Tensor | None
    overflow: bool = False


def finalize_gradients(
    params: list[nn.Parameter],
    tied_weight: torch.Tensor | None,
    state: ParallelState,
    *,
    loss_scale: float | None,
    clip_grad: float,
    buckets: GradBuckets | None = None,
) -> Gradients:
    """Steps 1 to 6 (``loss_scale`` None: no fp16 scaling). Gradients are left unclipped when
    the norm is not finite: the step that follows is skipped. Only fp16's overflow check reads
    the device."""
    reduce_gradients(params, tied_weight, state, buckets)
    if loss_scale is not None and unscale_and_check(params, loss_scale):
        return Gradients(None, overflow=True)
    norm = grad_norm(params, state)
    clip_gradients(params, clip_grad, norm)
    return Gradients(norm)
