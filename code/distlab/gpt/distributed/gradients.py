"""Gradient reduction: the first half of what happens between the last backward of a step and the
optimizer step (Megatron Core's ``distributed/finalize_model_grads.py``).

After the forward/backward of the step's ``m`` micro-batches each rank holds, in ``.grad``, the
gradient of its share of the loss, ``sum_k d(loss_k x S / m)`` (``S`` the fp16 loss scale, else
1). Then, in this order, on every layout:

1. tied embedding (pp > 1): ``dE = dE_first + dE_last`` over ``state.embedding_group``: E is one
   parameter used twice, held by the first and the last stage;
2. data (and context) parallel: ``g = (1 / (dp cp)) sum_r g_r`` over ``state.dp_cp_group`` (the
   ranks holding the same weights; cp ranks saw other tokens), flat all-reduces of the buckets of
   ``grad_buckets.py`` (one bucket by default), after the whole schedule as Megatron's
   ``finalize_model_grads``, or, with ``--overlap-grad-reduce``, started during the last
   micro-batch's backward (of each pipeline stage and model chunk) and only waited for here (the
   tied embedding's bucket starts here, after step 1);
   expert parameters (``p.expert_parallel``, ep > 1) instead over ``state.edp_group``, the
   ``dp cp / ep`` ranks that hold the same experts, still divided by dp cp: each rank's expert
   gradient already sums the tokens its ep group's ranks sent it, so the sum over the
   expert-data-parallel group covers all dp ranks' tokens once;
3. sequence parallel (``--sequence-parallel``): ``g = sum_r g_r`` over ``state.tp_group`` for
   the replicated parameters applied to sequence shards (tagged ``sequence_parallel``: the
   LayerNorms, row-parallel biases, the position table), each rank having the gradient of its
   T / tp positions only; one flat all-reduce, after step 2 (the two sums are over different
   ranks and commute; an overlapped bucket writes its average back into ``.grad`` at ``finish``).

Steps 4 to 6 (fp16's unscale, the global norm, clipping) are the optimizer's, as is
``finalize_gradients``, all six in order: ``optimizer/clip_grads.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.distributed.grad_buckets import GradBuckets, is_expert
from distlab.gpt.parallel_state import ParallelState


@torch.no_grad()
def reduce_gradients(
    params: Iterable[nn.Parameter],
    tied_weight: torch.Tensor | None,
    state: ParallelState,
    buckets: GradBuckets | None = None,
) -> None:
    """Steps 1 to 3: sum the tied embedding's two gradients, average over dp x cp through
    ``buckets`` (``grad_buckets.py``; default: one bucket of all dense ``params``, reduced now;
    experts: sum over the expert-data-parallel group, divide by dp x cp), then sum the
    sequence-parallel parameters' gradients over tp."""
    if tied_weight is not None and state.embedding_group is not None:
        if tied_weight.grad is None:
            tied_weight.grad = torch.zeros_like(tied_weight)
        dist.all_reduce(tied_weight.grad, group=state.embedding_group)
    params = list(params)
    if buckets is None:
        buckets = GradBuckets(
            params, state, bucket_size=max(1, sum(p.numel() for p in params)), overlap=False
        )
    buckets.finish()  # the dense parameters (every one when ep = 1)
    experts = [p.grad for p in params if p.grad is not None and state.ep > 1 and is_expert(p)]
    if experts:
        edp = state.layout.expert_data_size // state.ep
        _all_reduce_mean(experts, state.edp_group if edp > 1 else None, state.layout.expert_data_size)
    if state.layout.sequence_parallel:
        sharded = [p.grad for p in params if p.grad is not None and getattr(p, "sequence_parallel", False)]
        _all_reduce_mean(sharded, state.tp_group, 1)


def _all_reduce_mean(grads: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: int) -> None:
    """``g = (1 / divisor) sum_group g``, as one flat all-reduce (no group: the division alone)."""
    if not grads or (group is None and divisor == 1):
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one message instead of one per tensor
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat /= divisor
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
