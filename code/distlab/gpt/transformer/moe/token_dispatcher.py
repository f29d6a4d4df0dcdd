"""Token dispatchers: this rank's routed tokens to the ranks holding their experts, and the experts'
outputs back (Megatron Core's ``moe/token_dispatcher.py``, ``--moe-token-dispatcher-type``).

The experts of a layer live on the ``G = etp x ep`` ranks of one expert group (``tp_ep``: the ep
ranks that share out the E experts, E_l = E / ep each, times the etp = tp ranks that split every
expert's MLP; ``ExpertGroup``). Each of the G ranks routes its own N tokens (with sequence
parallelism the tp ranks hold different T / tp positions: megatron-core runs MoE with tp > 1 only
so). For the pairs (n, e) of the routing map, with weights p (N, E)::

    y_n = sum_e p_ne expert_e(x_n) = sum_e p_ne sum_r expert_e,r(x_n)      r: the etp shards of e

``allgather`` (Megatron's default, ``MoEAllGatherTokenDispatcher``)::

    all-gather x (N, H), p and the map over the G ranks            -> (G N, H), (G N, E)
    each rank: its E_l experts' pairs among the G N tokens, its shard of each expert
    y (G N, H) = sum of p_ne x its partial outputs, index-added per token
    reduce-scatter over the G ranks                                -> (N, H): sums the etp partials
                                                                      and the experts of every ep rank

Backward: the all-gather's gradient is a reduce-scatter and the reduce-scatter's an all-gather.
Every rank receives all G N tokens, most for other ranks' experts; no counts travel.

``alltoall`` (``MoEAlltoAllTokenDispatcher``): only the pairs a rank needs travel, in uneven
all-to-alls whose counts go first (``expert_parallel.py``). With etp = 1 it is Megatron's. With
etp > 1 this engine sends each pair to every etp shard of its expert in the same all-to-all over
the G ranks (the routing map widened to G E_l "virtual experts", expert e on ep rank j copied to
ranks ``j etp + r``), where Megatron sends over ep, then all-gathers over etp: the same rows reach
the same shards; the return all-to-all brings the etp partials home, where the weighted sum adds them.

With G = 1 both are the same local permutation: one process and every layout compute each pair alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.gpt.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel
from distlab.gpt.transformer.moe.expert_parallel import DispatchPlan, combine, dispatch


@dataclass(frozen=True)
class ExpertGroup:
    """Where a layer's experts live, seen from this rank."""

    num_experts: int  # E
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1  # expert-tensor-parallel size (= tp here)
    group: dist.ProcessGroup | None = None  # the G = etp x ep ranks (tp_ep), None when G = 1

    @property
    def size(self) -> int:
        return self.ep * self.etp

    @property
    def local(self) -> slice:
        """This rank's experts ``[ep_rank E_l, (ep_rank + 1) E_l)``."""
        per = self.num_experts // self.ep
        return slice(self.ep_rank * per, (self.ep_rank + 1) * per)


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (in group-rank order); backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)  # (G N, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [part.contiguous() for part in grad.chunk(dist.get_world_size(ctx.group))]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None


@dataclass
class _GatherPlan:
    token_index: torch.Tensor  # (R,): rows of the gathered tokens, pairs sorted by (expert, token)
    weights: torch.Tensor  # (R,)
    num_rows: int  # G N


def allgather_dispatch(
    tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: ExpertGroup
) -> tuple[list[torch.Tensor], _GatherPlan]:
    """tokens (N, H), probs and map (N, E) -> the inputs of this rank's E_l experts, (n_j, H) each."""
    if experts.group is not None:
        tokens = _GatherRows.apply(tokens, experts.group)  # (G N, H)
        probs = _GatherRows.apply(probs, experts.group)  # (G N, E)
        with torch.no_grad():
            routing_map = _GatherRows.apply(routing_map.to(torch.uint8), experts.group).bool()
    local_map = routing_map[:, experts.local]  # (G N, E_l)
    expert_index, token_index = local_map.T.nonzero(as_tuple=True)  # (R,) each, sorted by expert
    plan = _GatherPlan(token_index, probs[:, experts.local][token_index, expert_index], tokens.shape[0])
    return list(torch.split(tokens[token_index], local_map.sum(0).tolist())), plan


def allgather_combine(outputs: list[torch.Tensor], plan: _GatherPlan, experts: ExpertGroup) -> torch.Tensor:
    """The local experts' partial outputs -> y (N, H) of this rank's tokens."""
    out = torch.cat(outputs)  # (R, H)
    weighted = out * plan.weights.to(out.dtype).unsqueeze(1)
    y = torch.zeros((plan.num_rows, out.shape[1]), dtype=out.dtype, device=out.device)
    y = y.index_add(0, plan.token_index, weighted)  # (G N, H)
    if experts.group is None:
        return y
    return reduce_scatter_to_sequence_parallel(y.unsqueeze(0), experts.group).squeeze(0)  # (N, H)


def alltoall_dispatch(
    tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: ExpertGroup
) -> tuple[list[torch.Tensor], DispatchPlan]:
    """tokens (N, H), probs and map (N, E) -> the inputs of this rank's E_l experts (n_j, H)."""
    if experts.etp > 1:  # every pair to each etp shard of its expert: G E_l virtual experts
        n, ep, etp = tokens.shape[0], experts.ep, experts.etp
        routing_map = routing_map.view(n, ep, 1, -1).expand(n, ep, etp, -1).reshape(n, -1)  # (N, G E_l)
        probs = probs.view(n, ep, 1, -1).expand(n, ep, etp, -1).reshape(n, -1)
    return dispatch(tokens, probs, routing_map, group=experts.group, ep=experts.size)


def alltoall_combine(outputs: list[torch.Tensor], plan: DispatchPlan, experts: ExpertGroup) -> torch.Tensor:
    return combine(outputs, plan)


#: ``--moe-token-dispatcher-type`` -> (dispatch, combine).
DISPATCH = {
    "allgather": (allgather_dispatch, allgather_combine),
    "alltoall": (alltoall_dispatch, alltoall_combine),
}
