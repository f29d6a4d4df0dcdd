"""Expert parallelism: tokens to the ranks that hold their experts and back, with all-to-all
(the ``alltoall`` dispatcher of ``token_dispatcher.py``).

E experts over the ``ep`` ranks of an expert-parallel group, ``E_l = E / ep`` each (rank r holds
experts ``[r E_l, (r + 1) E_l)``; with expert tensor parallelism the group is the etp x ep ranks
and E its etp x E "virtual experts", ``token_dispatcher.alltoall_dispatch``). For one micro-batch of N tokens x (N, H), each routed to its k
experts (routing map (N, E), weights p (N, E))::

    permute   the R = sum(map) (token, expert) pairs, sorted by expert then token:  x_perm (R, H)
    counts    c[e] = pairs of this rank for expert e                                 (E,)
    exchange  all_to_all_single(c): c_in[s, j] = pairs rank s sends to my expert j   (ep, E_l)
    dispatch  all_to_all_single(x_perm), sending c.view(ep, E_l).sum(1) rows to each rank and
              receiving c_in.sum(1) from each: rows ordered (source, expert), regrouped (expert, source)
    experts   local expert j on its sum_s c_in[s, j] rows
    combine   regroup back to (source, expert), the all-to-all with the splits swapped, then
              y_n = sum_e p_ne out_ne, accumulated in the order of the pairs (expert order)

The splits are uneven and change every micro-batch: that is why the counts travel first (one
small all-to-all, and a device-to-host copy of them). The backward of an all-to-all is the same
all-to-all with input and output splits swapped (:class:`_AllToAll`); the permutations are index
operations that autograd differentiates. With ep = 1 nothing is sent: the same permutation with
every expert local, so one process and ep ranks compute each pair identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd: forward sends ``in_splits[r]`` rows to rank r and
    receives ``out_splits[r]`` from it; backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))  # (sum out_splits, H)
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of x (sum in_splits, ...) exchanged over ``group``: (sum out_splits, ...), differentiable."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts: torch.Tensor, group, ep: int) -> torch.Tensor:
    """counts (E,) of the pairs this rank sends to each expert -> (ep, E_l): row s, the pairs
    rank s sends to each of this rank's experts. One equal-split all-to-all of E integers."""
    received = torch.empty_like(counts)  # (E,)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


def _regroup(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Rows in chunks ordered (a, b) with sizes (A, B) -> the same chunks ordered (b, a)."""
    chunks = torch.split(x, sizes.flatten().tolist())
    A, B = sizes.shape
    return torch.cat([chunks[a * B + b] for b in range(B) for a in range(A)])


@dataclass
class DispatchPlan:
    """What :func:`combine` needs to undo :func:`dispatch`."""

    num_tokens: int  # N
    token_index: torch.Tensor  # (R,): the token of each pair, pairs sorted by (expert, token)
    weights: torch.Tensor  # (R,): p of each pair
    group: dist.ProcessGroup | None
    received: torch.Tensor | None = None  # (ep, E_l) pairs from each source to each local expert
    send_splits: list[int] | None = None  # pairs sent to each rank of the group
    recv_splits: list[int] | None = None  # pairs received from each rank


def dispatch(
    tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, *, group, ep: int
) -> tuple[list[torch.Tensor], DispatchPlan]:
    """tokens (N, H), probs and routing map (N, E) -> the inputs of this rank's E_l experts
    (a list of (n_j, H)) and the plan to combine their outputs."""
    expert_index, token_index = routing_map.T.nonzero(as_tuple=True)  # (R,) each, sorted by expert
    x_perm = tokens[token_index]  # (R, H)
    plan = DispatchPlan(tokens.shape[0], token_index, probs[token_index, expert_index], group)
    counts = routing_map.sum(0)  # (E,) int64
    if ep == 1:
        return list(torch.split(x_perm, counts.tolist())), plan
    received = exchange_counts(counts, group, ep)  # (ep, E_l)
    plan.received = received.cpu()
    plan.send_splits = counts.view(ep, -1).sum(1).tolist()
    plan.recv_splits = plan.received.sum(1).tolist()
    x_in = all_to_all(x_perm, plan.recv_splits, plan.send_splits, group)  # (sum recv, H), (source, expert)
    x_in = _regroup(x_in, plan.received)  # (expert, source)
    return list(torch.split(x_in, plan.received.sum(0).tolist())), plan


def combine(outputs: list[torch.Tensor], plan: DispatchPlan) -> torch.Tensor:
    """The experts' outputs (list of (n_j, H)) -> y (N, H), ``y_n = sum_e p_ne expert_e(x_n)``."""
    out = torch.cat(outputs)  # (rows, H), (expert, source)
    if plan.received is not None:
        out = _regroup(out, plan.received.T)  # (source, expert)
        out = all_to_all(out, plan.send_splits, plan.recv_splits, plan.group)  # (R, H), back home
    weighted = out * plan.weights.to(out.dtype).unsqueeze(1)  # (R, H)
    y = torch.zeros((plan.num_tokens, out.shape[1]), dtype=out.dtype, device=out.device)
    return y.index_add(0, plan.token_index, weighted)  # (N, H)
