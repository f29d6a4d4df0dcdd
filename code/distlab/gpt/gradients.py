"""Gradient finalisation: everything between the last backward of a step and the optimizer step.

After the forward/backward of the step's ``m`` micro-batches each rank holds, in ``.grad``, the
gradient of its share of the loss, ``sum_k d(loss_k x S / m)`` (``S`` the fp16 loss scale, else
1). Then, in this order, on every layout:

1. tied embedding (pp > 1): ``dE = dE_first + dE_last`` over ``state.embedding_group``: E is one
   parameter used twice, held by the first and the last stage;
2. sequence parallel (``--sequence-parallel``): ``g = sum_r g_r`` over ``state.tp_group`` for
   the replicated parameters applied to sequence shards (tagged ``sequence_parallel``: the
   LayerNorms, row-parallel biases, the position table), each rank having the gradient of its
   T / tp positions only; one flat all-reduce;
3. data parallel: ``g = (1 / dp) sum_r g_r``, one flat all-reduce over ``state.dp_group``, after
   the whole schedule (as Megatron's ``finalize_model_grads``; DDP's hook-driven all-reduce would
   need one "last" forward, which 1F1B's interleaving does not have);
4. fp16: divide by ``S`` and look for inf / nan on any rank (the step is then skipped);
5. global norm ``||g|| = sqrt(sum_p ||g_p||^2)`` over the model-parallel ranks, each parameter
   counted once (a replicated one on tp rank 0, E's copy on the last stage not at all);
6. clipping: every gradient times ``min(1, clip / ||g||)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.loss_scaler import unscale_and_check
from distlab.gpt.parallel_state import ParallelState


@torch.no_grad()
def reduce_gradients(
    params: Iterable[nn.Parameter], tied_weight: torch.Tensor | None, state: ParallelState
) -> None:
    """Steps 1 to 3: sum the tied embedding's two gradients, sum the sequence-parallel
    parameters' gradients over tp, then average over dp."""
    params = list(params)
    if tied_weight is not None and state.embedding_group is not None:
        if tied_weight.grad is None:
            tied_weight.grad = torch.zeros_like(tied_weight)
        dist.all_reduce(tied_weight.grad, group=state.embedding_group)
    if state.layout.sequence_parallel:
        sharded = [p.grad for p in params if p.grad is not None and getattr(p, "sequence_parallel", False)]
        _all_reduce_flat(sharded, state.tp_group, divide_by=1)
    if state.dp > 1:
        _all_reduce_flat([p.grad for p in params if p.grad is not None], state.dp_group, divide_by=state.dp)


def _all_reduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup, divide_by: int) -> None:
    """``g = (1 / divide_by) sum over group of g``, as one flat message instead of one per tensor."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if divide_by > 1:
        flat /= divide_by
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def grad_norm(params: Iterable[nn.Parameter], state: ParallelState | None) -> torch.Tensor:
    """Step 5: global L2 norm of the gradients (fp32 scalar), counted once per distinct parameter."""
    tp_rank = state.tp_rank if state is not None else 0
    pp = state.pp if state is not None else 1
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if getattr(p, "partition_dim", None) is None and tp_rank != 0:
            continue
        if getattr(p, "shared_embedding", False) and pp > 1:
            continue
        grads.append(p.grad.detach())
    if grads:
        total = torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()  # sum_p ||g_p||^2
    else:
        total = torch.zeros((), device=_collective_device())
    if state is not None:
        for group, size in ((state.tp_group, state.tp), (state.pp_group, state.pp)):
            if size > 1:
                dist.all_reduce(total, group=group)
    return total.sqrt()


def _collective_device() -> torch.device:
    """Where collectives of this rank's groups run: its GPU with nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def clip_gradients(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Step 6: scale all gradients by ``min(1, max_norm / norm)`` (no-op when ``max_norm`` is 0)."""
    if max_norm <= 0:
        return
    coeff = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coeff.to(grads[0].device))


@dataclass
class Gradients:
    """What finalisation found: the norm before clipping (None after an fp16 overflow)."""

    norm: float | None
    overflow: bool = False


def finalize_gradients(
    params: list[nn.Parameter],
    tied_weight: torch.Tensor | None,
    state: ParallelState,
    *,
    loss_scale: float | None,
    clip_grad: float,
) -> Gradients:
    """Steps 1 to 6 (``loss_scale`` None: no fp16 scaling). Gradients are left unclipped when
    the norm is not finite: the step that follows is skipped."""
    reduce_gradients(params, tied_weight, state)
    if loss_scale is not None and unscale_and_check(params, loss_scale):
        return Gradients(None, overflow=True)
    norm = grad_norm(params, state)
    if torch.isfinite(norm):
        clip_gradients(params, clip_grad, norm)
    return Gradients(float(norm))
