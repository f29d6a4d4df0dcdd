"""The top-k router and its load-balancing loss (Megatron Core's ``moe/router.py``, ``moe_utils.py``).

For the N tokens x (N, H) this rank routes, E experts and top-k (Megatron-LM's defaults: softmax
score, softmax *after* the top-k, ``--moe-router-load-balancing-type aux_loss``)::

    logits  = x W_r^T                                  (N, E), W_r: (E, H), no bias
    top_n   = topk(logits_n, k)                        the k experts of token n
    p_n     = softmax(logits_n[top_n])                 (k,): the k weights sum to 1

Capacity (``--moe-expert-capacity-factor c``): each expert keeps at most
``C = ceil(k N / E x c)`` of the tokens routed to it, those of highest p (Megatron's "probs" drop
policy), computed per rank and micro-batch; a dropped (token, expert) pair loses its term (the
residual stream still carries the token). No factor (or a negative one): dropless.

Load balancing (Switch Transformer / GShard, Megatron's ``switch_load_balancing_loss_func``) over
the N_tot tokens of one micro-batch's sequences, which sequence parallelism (T / tp per rank) and
context parallelism (T / cp) spread over the ``tp x cp`` ranks of one sequence::

    s_n     = softmax(logits_n)                        (E,), over all experts
    f_i     = #{n : i in topk(s_n, k)} / (k N_tot)     share of the routed slots expert i gets
    P_i     = (1 / N_tot) sum_n s_ni                   mean router probability of expert i
    l_aux   = E sum_i f_i P_i                          1 when balanced, at most E / k

The counts behind f are summed over those ranks (one all-reduce of E integers each); P is a sum
over tokens, so rank j computes ``l_j = E sum_i f_i P_ij`` from its own tokens and
``l_aux = sum_j l_j`` (Megatron's formula, ``moe_utils.py``). One process: j = 1, N_tot = N.

A token fills k *different* experts, so f_i <= 1/k, and sum_i P_i = 1: sum_i f_i P_i <= 1/k and
l_aux <= E / k, reached when k experts take every token (f_i = 1/k each) and one of them holds all
the router probability. E is the bound of top-1 routing only.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

#: ``--moe-router-load-balancing-type``: Megatron's choices, and why those not built are refused.
LOAD_BALANCING_TYPES = {
    "aux_loss": None,
    "none": None,
    "seq_aux_loss": "the per-sample loss of DeepSeek-V2 is not built here",
    "global_aux_loss": "the global-batch loss needs the counts of every micro-batch before the "
    "first backward; not built here",
    "sinkhorn": "S-BASE's Sinkhorn balancing is not built here",
    "quantile_balancing": "the per-expert bias of quantile balancing is not built here",
}


def route(
    logits: torch.Tensor, topk: int, capacity_factor: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Top-k, then softmax over the k, then the capacity: logits (N, E) -> probs (N, E), zero
    off the route; routing map (N, E) bool; number of (token, expert) pairs dropped."""
    num_tokens, num_experts = logits.shape
    top_logits, top = torch.topk(logits, k=topk, dim=1)  # (N, k) each
    weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32)  # (N, k)
    probs = torch.zeros_like(logits, dtype=torch.float32).scatter(1, top, weights)  # (N, E)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)  # (N, E)
    if capacity_factor is None:
        return probs, routing_map, 0
    capacity = math.ceil(topk * num_tokens / num_experts * capacity_factor)
    if capacity >= num_tokens:
        return probs, routing_map, 0
    kept = torch.topk(probs.detach(), k=capacity, dim=0).indices  # (C, E): each expert's best tokens
    keep = torch.zeros_like(routing_map).scatter(0, kept, True) & routing_map
    dropped = int(routing_map.sum() - keep.sum())
    return probs * keep, keep, dropped


def load_balancing_loss(
    logits: torch.Tensor, topk: int, groups: tuple[dist.ProcessGroup | None, ...] = ()
) -> torch.Tensor:
    """This rank's share ``l_j = E sum_i f_i P_ij`` of ``l_aux`` for its logits (N, E), without
    the coefficient (fp32 scalar). ``groups``: the ranks holding the other tokens of the same
    sequences (the tp group under sequence parallelism, the cp group); their counts are summed.
    With no group ``l_j = l_aux``."""
    num_tokens, num_experts = logits.shape
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
    top = torch.topk(scores, k=topk, dim=1).indices  # (N, k)
    slots = torch.zeros_like(scores).scatter(1, top, 1.0).sum(0)  # (E,): f_i k N_tot, this rank's part
    total = num_tokens
    for group in groups:
        if group is not None:
            dist.all_reduce(slots, group=group)  # counts only: no gradient flows through f
            total *= dist.get_world_size(group)
    return num_experts * (slots * scores.sum(0)).sum() / (topk * total * total)
