"""Mixture of experts: the top-k router, its load-balancing loss, and the layer that replaces the MLP.

For the N = b T tokens x (N, H) of a micro-batch, E experts (each an MLP H -> F -> H) and top-k
(Megatron-LM's defaults: softmax score, softmax *after* the top-k, ``aux_loss`` balancing)::

    logits  = x W_r^T                                  (N, E), W_r: (E, H), no bias
    top_n   = topk(logits_n, k)                        the k experts of token n
    p_n     = softmax(logits_n[top_n])                 (k,): the k weights sum to 1
    y_n     = sum_{e in top_n} p_ne expert_e(x_n)      (N, H)

Capacity (``--moe-expert-capacity-factor c``): each expert keeps at most
``C = ceil(k N / E x c)`` of the tokens routed to it, those of highest p (Megatron's "probs" drop
policy), computed per rank and micro-batch; a dropped (token, expert) pair loses its term (the
residual stream still carries the token). No factor (or a negative one): dropless.

Load balancing (Switch Transformer / GShard, Megatron's ``switch_load_balancing_loss_func``)::

    s_n     = softmax(logits_n)                        (E,), over all experts
    f_i     = #{n : i in topk(s_n, k)} / (k N)         share of the routed slots expert i gets
    P_i     = (1 / N) sum_n s_ni                       mean router probability of expert i
    l_aux   = E sum_i f_i P_i                          1 when balanced, at most E / k

A token fills k *different* experts, so f_i <= 1/k, and sum_i P_i = 1: sum_i f_i P_i <= 1/k and
l_aux <= E / k, reached when k experts take every token (f_i = 1/k each) and one of them holds all
the router probability. E is the bound of top-1 routing only.

The objective is ``lm loss + coeff sum_layers l_aux`` (``--moe-aux-loss-coeff``); the log reports
``l_aux`` per layer without the coefficient (Megatron's ``load_balancing_loss``). The experts of
one layer are split over the ``ep`` ranks of an expert-parallel group (``expert_parallel.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab.gpt.moe.expert_parallel import combine, dispatch


@dataclass
class MoEConfig:
    """The MLP of every block as a mixture of experts (Megatron's ``--num-experts`` and ``--moe-*``)."""

    num_experts: int
    """E, experts per layer (``--num-experts``)."""
    topk: int = 2
    """k, experts per token (``--moe-router-topk``)."""
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss in the objective (``--moe-aux-loss-coeff``)."""
    capacity_factor: float | None = None
    """c (``--moe-expert-capacity-factor``): None or negative, dropless."""

    def __post_init__(self) -> None:
        errors = config_errors(self.num_experts, self.topk, self.capacity_factor)
        if errors:
            raise ValueError("; ".join(errors))
        if self.capacity_factor is not None and self.capacity_factor < 0:
            self.capacity_factor = None  # Megatron: a negative factor means dropless

    def describe(self, ep: int) -> str:
        """The start-up line: experts, their split, routing and capacity."""
        drop = "dropless" if self.capacity_factor is None else f"capacity factor {self.capacity_factor:g}"
        return (
            f"> MoE: {self.num_experts} experts per layer, top-{self.topk} routing, expert-model-parallel "
            f"size {ep} ({self.num_experts // ep} experts per rank), {drop}, aux loss coeff "
            f"{self.aux_loss_coeff:g}"
        )


def config_errors(num_experts: int, topk: int, capacity_factor: float | None) -> list[str]:
    """What makes a router impossible, each message naming the values and the fix."""
    errors = []
    if num_experts < 1:
        errors.append(f"--num-experts {num_experts} must be >= 1 (leave it out for a dense MLP)")
    elif not 1 <= topk <= num_experts:
        errors.append(
            f"--moe-router-topk {topk} must be between 1 and --num-experts {num_experts}: a token "
            f"cannot go to more experts than there are; lower the top-k or add experts"
        )
    if capacity_factor == 0:
        errors.append(
            "--moe-expert-capacity-factor 0 would drop every token: give a positive factor, or none "
            "(or a negative one) for dropless routing"
        )
    return errors


def placement_errors(num_experts: int, ep: int) -> list[str]:
    """The experts must split evenly over the expert-parallel ranks."""
    if num_experts % ep:
        return [
            f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}: each "
            f"rank holds E / ep whole experts; choose a multiple of {ep} experts or an ep that divides "
            f"{num_experts}"
        ]
    return []


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


def load_balancing_loss(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """``l_aux = E sum_i f_i P_i`` of logits (N, E), without its coefficient (fp32 scalar)."""
    num_tokens, num_experts = logits.shape
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
    top = torch.topk(scores, k=topk, dim=1).indices  # (N, k)
    slots = torch.zeros_like(scores).scatter(1, top, 1.0).sum(0)  # (E,): f_i k N
    return num_experts * (slots * scores.sum(0)).sum() / (topk * num_tokens * num_tokens)


class ExpertMLP(nn.Module):
    """One expert: H -> F -> GELU -> H (the dense MLP's shape)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n, H) -> (n, H)
        return self.fc2(F.gelu(self.fc1(x)))


@dataclass
class RouterStats:
    """One layer's routing during the iteration so far (this rank's tokens, training forwards)."""

    tokens_per_expert: torch.Tensor  # (E,) int64
    aux_loss_sum: float = 0.0  # sum of l_aux over the micro-batches
    micro_batches: int = 0
    dropped: int = 0


class MoELayer(nn.Module):
    """Router and this rank's ``E / ep`` experts, keyed by their global index (so that
    ``model.init_parameters`` gives expert e the same weights on every layout)."""

    def __init__(
        self,
        cfg: MoEConfig,
        hidden: int,
        ffn: int,
        *,
        ep_group: dist.ProcessGroup | None,
        ep: int,
        ep_rank: int,
    ) -> None:
        super().__init__()
        errors = placement_errors(cfg.num_experts, ep)
        if errors:
            raise ValueError("; ".join(errors))
        self.cfg, self.ep_group, self.ep = cfg, ep_group, ep
        self.router = nn.Linear(hidden, cfg.num_experts, bias=False)  # W_r: (E, H)
        local = cfg.num_experts // ep
        self.experts = nn.ModuleDict(
            {str(e): ExpertMLP(hidden, ffn) for e in range(ep_rank * local, (ep_rank + 1) * local)}
        )
        for p in self.experts.parameters():
            p.expert_parallel = True  # gradients summed over the expert-data-parallel group, / (dp x cp)
        self.aux_loss: torch.Tensor | None = None  # l_aux of the last training forward, for the model
        self.stats = RouterStats(torch.zeros(cfg.num_experts, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, T, H = x.shape
        tokens = x.reshape(b * T, H)  # (N, H)
        logits = self.router(tokens)  # (N, E)
        probs, routing_map, dropped = route(logits, self.cfg.topk, self.cfg.capacity_factor)
        if self.training and torch.is_grad_enabled():
            self.aux_loss = load_balancing_loss(logits, self.cfg.topk)
            s = self.stats
            s.tokens_per_expert += routing_map.sum(0).cpu()
            s.aux_loss_sum += float(self.aux_loss.detach())
            s.micro_batches += 1
            s.dropped += dropped
        inputs, plan = dispatch(
            tokens, probs, routing_map, group=self.ep_group, ep=self.ep
        )  # E/ep x (n_j, H)
        outputs = [expert(chunk) for expert, chunk in zip(self.experts.values(), inputs, strict=True)]
        return combine(outputs, plan).view(b, T, H)


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: the per-token loss (b, T) unchanged (the logged lm loss). Backward: the aux loss
    receives the sum of the gradient reaching the per-token loss, which is the gradient reaching
    ``loss.mean()``: the backward of ``mean(loss)`` becomes that of ``mean(loss) + aux``, scaled
    by whatever scales the lm loss (``S / m``)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.sum()


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def attach_aux_loss(loss: torch.Tensor, model: nn.Module, coeff: float) -> torch.Tensor:
    """The per-token loss with ``coeff sum_layers l_aux`` of this forward attached for backward
    (the caller reduces it with ``.mean()``); takes the layers' aux losses."""
    auxes = []
    for layer in moe_layers(model):
        if layer.aux_loss is not None:
            auxes.append(layer.aux_loss)
        layer.aux_loss = None
    if not auxes or coeff == 0:
        return loss
    return _AttachAuxLoss.apply(loss, coeff * torch.stack(auxes).sum())


def take_stats(model: nn.Module, group: dist.ProcessGroup | None) -> list[dict]:
    """Every MoE layer's routing since the last call, summed over ``group`` (the data-parallel
    ranks; collective when given), then reset: ``tokens_per_expert`` (list of E ints), mean
    ``load_balancing_loss`` over micro-batches and ranks, ``dropped`` pairs."""
    layers = moe_layers(model)
    if not layers:
        return []
    rows = [
        torch.cat([s.tokens_per_expert.double(), torch.tensor([s.aux_loss_sum, s.micro_batches, s.dropped])])
        for s in (layer.stats for layer in layers)
    ]
    table = torch.stack(rows)  # (layers, E + 3), float64: exact for counts below 2^53
    if group is not None:
        device = next(model.parameters()).device if dist.get_backend(group) == "nccl" else "cpu"
        on = table.to(device)
        dist.all_reduce(on, group=group)
        table = on.cpu()
    for layer in layers:
        layer.stats = RouterStats(torch.zeros_like(layer.stats.tokens_per_expert))
    E = layers[0].cfg.num_experts
    return [
        {
            "tokens_per_expert": [int(c) for c in row[:E]],
            "load_balancing_loss": float(row[E] / max(1.0, float(row[E + 1]))),
            "dropped": int(row[E + 2]),
        }
        for row in table
    ]
