"""Mixture of experts: the layer that replaces a block's MLP (Megatron Core's ``moe/moe_layer.py``).

For this rank's N tokens x (N, H) of a micro-batch (N = b T, or b T / tp with sequence parallelism,
b T / cp with context parallelism), E experts and top-k::

    route     probs p (N, E), routing map (N, E)          router.py: softmax over the top-k logits
    dispatch  each (token, expert) pair to the rank holding the expert  token_dispatcher.py
    experts   this rank's E / ep experts, each on its rows (its etp shard)  experts.py
    combine   y_n = sum_e p_ne expert_e(x_n)              (N, H), back on this rank

The objective is ``lm loss + coeff sum_layers l_aux`` (``--moe-aux-loss-coeff``). As Megatron's
``MoEAuxLossAutoScaler``, each layer attaches its own ``l_aux`` to its output: forward returns y
unchanged, backward gives ``l_aux`` the gradient ``coeff x S / m`` (S the fp16 loss scale, else
1; m micro-batches: the lm loss's own factor, which the step sets with :func:`set_aux_loss_scale`),
so the aux loss of a layer on any pipeline stage joins that stage's backward, micro-batch by
micro-batch. Under sequence and context parallelism each rank holds ``l_j``, its share of the
sequence's l_aux (router.py): the router's gradient is summed over tp (sequence-parallel
parameters) and averaged over dp x cp like every gradient, so each cp rank's share is scaled by
cp to give ``sum_j grad l_j`` after the average (Megatron's ``forward_step`` sets the same
``loss scale x cp / m``). The log reports ``l_aux`` per layer without the
coefficient (Megatron's ``load_balancing_loss``).

With tp > 1 megatron-core runs MoE only with sequence parallelism (``MoELayer.forward`` refuses
training without it): the tp ranks route different tokens, and the experts are split over the
same tp ranks (etp = tp, ``experts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tensor_parallel.layers import mark_sequence_parallel
from distlab.gpt.transformer.moe.experts import ExpertMLP
from distlab.gpt.transformer.moe.router import load_balancing_loss, route
from distlab.gpt.transformer.moe.token_dispatcher import DISPATCH, ExpertGroup


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
    token_dispatcher: str = "allgather"
    """``--moe-token-dispatcher-type``: allgather (Megatron's default) or alltoall."""
    load_balancing_type: str = "aux_loss"
    """``--moe-router-load-balancing-type``: aux_loss, or none (no loss, nothing logged)."""
    grouped_gemm: bool = False
    """``--moe-grouped-gemm``: accepted; the local experts run in a loop either way (``experts.py``)."""
    gated_linear_unit: bool = False
    """SwiGLU experts (``--swiglu``): fc1 H -> 2F, silu(gate) * up."""
    add_bias_linear: bool = True
    """Biases in the experts' fc1 and fc2 (``--disable-bias-linear`` clears it)."""
    openai_gelu: bool = False
    """``--openai-gelu``: non-gated experts' GeLU is the tanh approximation."""

    def __post_init__(self) -> None:
        errors = config_errors(self.num_experts, self.topk, self.capacity_factor)
        if self.token_dispatcher not in DISPATCH:
            errors.append(f"token dispatcher {self.token_dispatcher!r} is not one of {sorted(DISPATCH)}")
        if self.load_balancing_type not in ("aux_loss", "none"):
            errors.append(f"load balancing type {self.load_balancing_type!r} is not aux_loss or none")
        if errors:
            raise ValueError("; ".join(errors))
        if self.capacity_factor is not None and self.capacity_factor < 0:
            self.capacity_factor = None  # Megatron: a negative factor means dropless

    def describe(self, ep: int, etp: int = 1) -> str:
        """The start-up line: experts, their split, routing, dispatcher and capacity."""
        drop = "dropless" if self.capacity_factor is None else f"capacity factor {self.capacity_factor:g}"
        gemm = "--moe-grouped-gemm: no grouped GEMM here, " if self.grouped_gemm else ""
        return (
            f"> MoE: {self.num_experts} experts per layer, top-{self.topk} routing, expert-model-parallel "
            f"size {ep} ({self.num_experts // ep} experts per rank), expert-tensor-parallel size {etp}, "
            f"{self.token_dispatcher} token dispatcher, {gemm}a loop over the local experts, {drop}, "
            f"{self.load_balancing_type} load balancing, aux loss coeff {self.aux_loss_coeff:g}"
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


@dataclass
class RouterStats:
    """One layer's routing during the iteration so far (this rank's tokens, training forwards)."""

    tokens_per_expert: torch.Tensor  # (E,) int64
    aux_loss_sum: float = 0.0  # sum of this rank's share l_j over the micro-batches
    micro_batches: int = 0
    dropped: int = 0


class _AuxLossScaler(torch.autograd.Function):
    """Forward: y unchanged. Backward: y's gradient, and ``scale`` for the aux loss (Megatron's
    ``MoEAuxLossAutoScaler``): the backward of ``y`` becomes that of ``y`` and ``scale x l_aux``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoELayer(nn.Module):
    """Router and this rank's ``E / ep`` experts (their etp shards), keyed by their global index
    (so that ``gpt_model.init_parameters`` gives expert e the same weights on every layout)."""

    def __init__(self, cfg: MoEConfig, hidden: int, ffn: int, state: ParallelState | None = None) -> None:
        super().__init__()
        ep, ep_rank = (state.ep, state.ep_rank) if state is not None else (1, 0)
        tp, tp_rank = (state.tp, state.tp_rank) if state is not None else (1, 0)
        sp = state is not None and state.layout.sequence_parallel
        # The experts over ep and sequence parallelism under tp: model_layout's rules, which the
        # model (GPTModel) and validate_args check before any layer is built.
        self.cfg = cfg
        group = state.tp_ep_group if ep * tp > 1 else None
        self.where = ExpertGroup(cfg.num_experts, ep, ep_rank, tp, group)
        #: The ranks holding the other tokens of this rank's sequences: tp (sequence parallelism), cp.
        self.token_groups = tuple(
            g for g, size in ((state.tp_group, tp), (state.cp_group, state.cp)) if size > 1
        ) if state is not None else ()  # fmt: skip
        self.cp = state.cp if state is not None else 1
        self.router = nn.Linear(hidden, cfg.num_experts, bias=False)  # W_r: (E, H)
        if sp:
            mark_sequence_parallel(self.router.weight)  # each tp rank routes its own T / tp tokens
        local = self.where.local
        self.experts = nn.ModuleDict(
            {
                str(e): ExpertMLP(hidden, ffn, etp=tp, etp_rank=tp_rank, gated=cfg.gated_linear_unit,
                                  bias=cfg.add_bias_linear, openai_gelu=cfg.openai_gelu)
                for e in range(local.start, local.stop)
            }
        )  # fmt: skip
        for p in self.experts.parameters():
            p.expert_parallel = True  # gradients summed over the expert-data-parallel group, / (dp x cp)
        self.aux_loss_scale = 1.0  # S / m, set by the step (:func:`set_aux_loss_scale`)
        self.aux_loss: torch.Tensor | None = None  # l_j of the last training forward
        self.stats = RouterStats(torch.zeros(cfg.num_experts, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, T, H = x.shape  # T: this rank's positions (T / tp with SP, T / cp with CP)
        tokens = x.reshape(b * T, H)  # (N, H)
        logits = self.router(tokens)  # (N, E)
        probs, routing_map, dropped = route(logits, self.cfg.topk, self.cfg.capacity_factor)
        self.aux_loss = None
        if self.training and torch.is_grad_enabled():
            if self.cfg.load_balancing_type == "aux_loss":
                self.aux_loss = load_balancing_loss(logits, self.cfg.topk, self.token_groups)
            s = self.stats
            s.tokens_per_expert += routing_map.sum(0).cpu()
            s.aux_loss_sum += 0.0 if self.aux_loss is None else float(self.aux_loss.detach())
            s.micro_batches += 1
            s.dropped += dropped
        dispatch, combine = DISPATCH[self.cfg.token_dispatcher]
        inputs, plan = dispatch(tokens, probs, routing_map, self.where)  # E / ep x (n_j, H)
        outputs = [expert(chunk) for expert, chunk in zip(self.experts.values(), inputs, strict=True)]
        y = combine(outputs, plan, self.where).view(b, T, H)
        if self.aux_loss is not None and self.cfg.aux_loss_coeff:
            y = _AuxLossScaler.apply(
                y, self.aux_loss, self.cfg.aux_loss_coeff * self.cp * self.aux_loss_scale
            )
        return y


def moe_layers(model: nn.Module) -> list[tuple[int, MoELayer]]:
    """This rank's MoE layers with their global block index (from the name ``layers.<i>.mlp``)."""
    return [(int(name.split(".")[-2]), m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The factor of the lm loss's backward this step (``S / m``), given to the aux losses too."""
    for _, layer in moe_layers(model):
        layer.aux_loss_scale = scale


def take_stats(model: nn.Module, state: ParallelState | None = None) -> list[dict]:
    """Every MoE layer's routing since the last call, then reset. With ``state`` (collective on
    every rank): summed over the ranks holding other tokens (dp x cp, and tp with sequence
    parallelism) and gathered over the pipeline stages, in block order: ``layer`` (global
    index), ``tokens_per_expert`` (list of E ints), mean ``load_balancing_loss`` over
    micro-batches and ranks (the shares l_j of one micro-batch's sequences add up to its l_aux),
    ``dropped`` pairs."""
    layers = moe_layers(model)
    if not layers:
        return []
    rows = [
        torch.cat([s.tokens_per_expert.double(), torch.tensor([s.aux_loss_sum, s.micro_batches, s.dropped])])
        for s in (layer.stats for _, layer in layers)
    ]
    table = torch.stack(rows)  # (layers, E + 3), float64: exact for counts below 2^53
    index = torch.tensor([[float(i)] for i, _ in layers], dtype=torch.float64)  # (layers, 1)
    for _, layer in layers:
        layer.stats = RouterStats(torch.zeros_like(layer.stats.tokens_per_expert))
    E = layers[0][1].cfg.num_experts
    if state is not None:
        sp = state.tp if state.layout.sequence_parallel else 1
        device = (
            next(model.parameters()).device
            if dist.is_initialized() and dist.get_backend() == "nccl"
            else "cpu"
        )
        table = torch.cat([table, index], dim=1).to(device)
        for group, size in ((state.dp_cp_group, state.dp * state.cp), (state.tp_group, sp)):
            if size > 1:
                summed = table[:, :-1].clone()
                dist.all_reduce(summed, group=group)
                table[:, :-1] = summed
        table[:, E + 1] /= state.cp * sp  # each micro-batch counted once, not once per token shard
        if state.pp > 1:  # every stage has L / pp layers: equal shapes
            parts = [torch.empty_like(table) for _ in range(state.pp)]
            dist.all_gather(parts, table.contiguous(), group=state.pp_group)
            table = torch.cat(parts)
        table, index = table[:, :-1].cpu(), table[:, -1].cpu()
    order = index.flatten().argsort()
    return [
        {
            "layer": int(index.flatten()[i]),
            "tokens_per_expert": [int(c) for c in table[i, :E]],
            "load_balancing_loss": float(table[i, E] / max(1.0, float(table[i, E + 1]))),
            "dropped": int(table[i, E + 2]),
        }
        for i in order.tolist()
    ]
