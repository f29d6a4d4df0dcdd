"""Predict one training step's time from FLOPs, bandwidths and the pipeline bubble.

Per device, with W devices, m micro-batches per rank, p pipeline stages, v chunks per stage::

    compute        F / W / (peak x achieved fraction)          F: the step's FLOPs (training/flops.py)
    collective     alpha + factor(n) x bytes / bandwidth       bytes: the whole buffer (nccl-tests' size)
                   factor: all-reduce 2(n-1)/n, all-gather, reduce-scatter and all-to-all (n-1)/n,
                   send/recv 1 (``distlab.comm.bench.BUS_FACTOR``); alpha and bandwidth those of
                   the link the group crosses: inside one node, or between nodes if its ranks
                   lie on more than one (Megatron's tp-cp-dp-pp rank order, ``layout.py``)
    micro-batch    t_mb = compute / m + tp + pp + ep + exposed cp + unfused   (per micro-batch, a stage)
    pipeline       t_mb (m + (p - 1) / v): the bubble is (p - 1) / (v m + p - 1) of it   [convention:
                   the fraction of the whole pipelined time, not of the ideal compute]; the last
                   stage also runs the output layer (6 B s h V FLOPs, 22% of a 4-layer GPT with
                   h 256 and V 4096): 1F1B takes the sum of the stages' t_mb plus (m - 1) times
                   the slowest's, t_last m + (p - 1) t_other / v
    step           pipeline + exposed data-parallel communication + optimizer

The FLOPs executed are the model FLOPs (with the experts' k MLPs per token) plus what
``engine_work.py`` counts: the router; without fused attention (this engine's ring) the ring's
2 cp + 1 blocks with the backward's recomputed scores in place of the counted attention. Hardware with an
``elementwise`` figure (the local machine) also pays the ring's and the expert permutation's
unfused passes, as bytes / bandwidth + kernels x latency; with a ``memory`` figure, the update's
(gradient norm, clipping, AdamW, the buckets' copies: ``engine_work.optimizer_seconds``).

Which communication is hidden: tensor-parallel (and expert dispatch) collectives sit between
GEMMs and are counted in full; a context-parallel K/V round is hidden under one ring step's
attention work (the layer's ring work / 2 cp), the engine's gradient rounds are waited at once
(a fused ring hides them like K/V); pipeline sends are counted in full (2 v per micro-batch); the
gradient reduction (an all-reduce, or the distributed optimizer's reduce-scatter plus all-gather of
the parameters; experts over their own expert-data-parallel group) is hidden up to one
micro-batch's backward (2/3 of t_mb) with ``--overlap-grad-reduce``, else exposed; FSDP's gathers
and reduce-scatters (once per micro-batch) overlap the whole compute. Per layer and micro-batch,
activations ``S = b (s / cp) H`` x bytes::

    tp, no SP    4 all-reduces of S (2 forward, 2 backward)
    tp, SP       6 all-gathers + 4 reduce-scatters of S (backward gathers the input again for the
                 weight gradient, as this engine and Megatron do); full recomputation reruns the
                 forward up to its last GEMM (PyTorch's checkpoint stops early): + 1 all-reduce,
                 or + 2 all-gathers + 1 reduce-scatter; with --hidden-dropout > 0 it reruns the
                 block's last collective too (the dropout after it recomputes its mask): + 1 more
    tp, head     per micro-batch the embedding's and output layer's, the cross entropy's two
                 (``engine_work.head_collectives``)
    cp           3 cp - 2 rounds (``engine_work``: cp - 1 K/V forward, cp - 1 K/V and cp gradient
                 accumulators backward), one send each
    ep           the dispatcher's all-to-alls or all-gathers and reduce-scatters
                 (``engine_work.dispatch_collectives``)

Left out: the sequence-parallel norms' gradient all-reduce, the gradient norm's scalar, data loading.

On GPUs fused attention skips the masked half of causal attention (``flash_attention`` in the
hardware file): the compute time counts Q K^T and the scores times V at half, and
:attr:`StepPrediction.mfu` and :attr:`StepPrediction.hfu` count FLOPs as ``utilization.py`` names
them (model FLOPs, and those plus the recomputed forward; attention at the causal half).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distlab.comm.bench import BUS_FACTOR
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.from_args import model_flops_per_iteration, output_layer_flops, recomputed_layers
from distlab.gpt.distributed.grad_buckets import default_bucket_size
from distlab.gpt.layout import Layout
from distlab.gpt.planning import engine_work as work
from distlab.gpt.planning.hardware import Hardware, Link
from distlab.gpt.planning.utilization import hardware_flops, model_flops

#: Bus factor of each operation over n ranks (send and recv move their bytes once).
FACTOR = {**BUS_FACTOR, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}


def collective_seconds(op: str, n: int, nbytes: float, link: Link) -> float:
    """alpha + factor(n) x bytes / bandwidth, or the link's measured sweep at this size where it has
    one for ``op`` over ``n`` ranks (``Link.measured_seconds``); 0 for a group of one rank."""
    if n <= 1:
        return 0.0
    measured = link.measured_seconds(op, n, nbytes)
    if measured is not None:
        return measured
    return link.latency + FACTOR[op](n) * nbytes / link.bandwidth


def bubble_fraction(pp: int, m: int, v: int = 1) -> float:
    """(p - 1) / (v m + p - 1): the idle share of the whole pipelined time (1F1B: v = 1)."""
    return (pp - 1) / (v * m + pp - 1)


def group_link(groups: list[list[int]], hw: Hardware) -> Link:
    """The link a group's collectives cross: inter-node if any group's ranks span two nodes."""
    spans = any(len({r // hw.gpus_per_node for r in ranks}) > 1 for ranks in groups)
    return hw.inter_node if spans else hw.intra_node


def attention_flops(args: PretrainArgs) -> float:
    """Q K^T and the scores times V of one step, counted in full: ``B s (3 l + r) 4 s n d``
    (``training/flops.py``'s attention term of one block's forward per token)."""
    B, s = args.global_batch_size, args.seq_length
    nd = (args.kv_channels or args.hidden_size // args.num_attention_heads) * args.num_attention_heads
    return float(B * s) * (3 * args.num_layers + recomputed_layers(args)) * 4 * s * nd


def kv_width(args: PretrainArgs) -> int:
    """g d: the K (or V) channels of a token; n d (= H) without grouped-query attention."""
    d = args.kv_channels or args.hidden_size // args.num_attention_heads
    return (args.num_query_groups if args.group_query_attention else args.num_attention_heads) * d


@dataclass(frozen=True)
class Cost:
    """One kind of communication of a step: ``count`` calls of ``op`` over ``n`` ranks."""

    dim: str
    op: str
    n: int
    nbytes: float
    count: int
    link: Link
    what: str = "layers"  # layers, head (tp), rounds (cp), dispatch (ep), gradients (dp)

    @property
    def seconds(self) -> float:
        return self.count * collective_seconds(self.op, self.n, self.nbytes, self.link)


@dataclass
class StepPrediction:
    """The step's time and where it goes (seconds per step, per device)."""

    compute: float
    bubble: float
    exposed: dict[str, float]  # per dimension: tp, cp, pp, ep, dp
    step: float
    bubble_fraction: float
    mfu: float  # model FLOPs utilisation (utilization.MFU_CONVENTION)
    hfu: float  # hardware FLOPs utilisation: + the recomputed forward (utilization.HFU_CONVENTION)
    tokens_per_s_per_device: float
    costs: list[Cost] = field(default_factory=list)
    unfused: float = 0.0  # memory-bound passes (ring attention, expert permutation), not communication
    optimizer: float = 0.0  # the update's memory-bound passes (norm, clipping, AdamW, buckets)
    # the last stage's compute above the stages' mean (its output layer), m x head (1 - 1/p): the
    # others wait for it; step = compute + last_stage + bubble + exposed + unfused + optimizer
    last_stage: float = 0.0


def predict_step(
    args: PretrainArgs,
    layout: Layout,
    hw: Hardware,
    vocab_size: int,
    parameters_per_rank: float,
    *,
    distributed_optimizer: bool = False,
) -> StepPrediction:
    """Predict one step of ``args`` on ``layout`` over ``hw`` (see the module docstring);
    ``parameters_per_rank``: the largest stage's parameters on one rank (its gradients are reduced)."""
    W, m, v, pp = layout.world_size, layout.num_micro_batches, layout.vp, layout.pp
    act = work.act_bytes(args)
    F = model_flops_per_iteration(args, vocab_size)
    fused = hw.flash_attention
    executed = F + work.router_flops(args)
    if fused:
        executed -= attention_flops(args) / 2
    elif layout.cp > 1:
        executed += work.ring_attention_flops(args, layout.cp) - attention_flops(args)
    compute = executed / W / hw.achieved_flops  # per device, per step
    link = {d: group_link(layout.groups(d), hw) for d in ("tp", "cp", "dp", "pp")}
    layers = args.num_layers / pp  # this stage's blocks
    S = layout.micro_batch_size * (args.seq_length / layout.cp) * args.hidden_size * act
    full_recompute = recomputed_layers(args) > 0
    rerun_tail = full_recompute * (2 if args.hidden_dropout > 0 else 1)  # the block's g (and its last)
    costs, unfused, exposed_cp = [], 0.0, 0.0
    if layout.tp > 1:
        per_layer = (
            [("all_gather", 6 + 2 * full_recompute), ("reduce_scatter", 4 + rerun_tail)]
            if layout.sequence_parallel
            else [("all_reduce", 4 + rerun_tail)]
        )
        costs += [Cost("tp", op, layout.tp, S, round(k * layers), link["tp"]) for op, k in per_layer]
        costs += [
            Cost("tp", op, layout.tp, b, k, link["tp"], "head")
            for op, b, k in work.head_collectives(args, layout, S)
        ]
    if layout.cp > 1:
        exposed_cp, ring, unfused = _ring(args, layout, hw, link["cp"], layers)
        costs += ring
    if pp > 1:
        p2p = S / (layout.tp if layout.sequence_parallel else 1)
        costs.append(Cost("pp", "send", 2, p2p, 2 * v, link["pp"]))
    if args.num_experts is not None:
        ep_link = group_link(layout.tp_ep_groups(), hw)
        G = layout.tp * layout.ep
        costs += [
            Cost("ep", op, G, b, round(k * layers), ep_link, "dispatch")
            for op, b, k in work.dispatch_collectives(args, layout)
        ]
        if hw.elementwise is not None:
            unfused += layers * work.permute_unfused_seconds(args, layout, hw.elementwise)
    per_mb = {d: sum(c.seconds for c in costs if c.dim == d) for d in ("tp", "pp", "ep")}
    per_mb["cp"] = exposed_cp
    # the last stage also runs the output layer (the first's embedding is a lookup): per micro-batch
    head = output_layer_flops(args, vocab_size) / (W / pp) / hw.achieved_flops / m if pp > 1 else 0.0
    head_comm = sum(c.seconds for c in costs if c.what == "head")
    t_other = (compute - head * m / pp) / m + sum(per_mb.values()) - head_comm + unfused
    t_mb = t_other + head + head_comm  # the last stage's, the pipeline's slowest
    pipeline = t_mb * m + (pp - 1) * t_other / v  # 1F1B: sum of the stages + (m - 1) x the slowest
    experts = work.expert_parameters(args, layout)  # reduced over their own group, in one flat all-reduce
    dp_costs = _data_parallel_costs(args, layout, hw, parameters_per_rank - experts, distributed_optimizer, m)
    edp = layout.expert_data_size // layout.ep
    if experts and edp > 1:
        dp_costs.append(
            Cost("dp", "all_reduce", edp, experts * 4, 1, group_link(layout.edp_groups(), hw), "experts")
        )
    dp_time = sum(c.seconds for c in dp_costs)
    if args.use_torch_fsdp2:
        hidden = compute
    else:
        hidden = 2 / 3 * t_mb if args.overlap_grad_reduce else 0.0
    exposed_dp = max(0.0, dp_time - hidden)
    optimizer = 0.0
    if hw.memory is not None:  # the update's memory-bound passes (GPU files: not modelled)
        d = layout.dp * layout.cp
        dense = parameters_per_rank - experts
        updated = dense / d + experts / max(1, edp) if distributed_optimizer else parameters_per_rank
        optimizer = work.optimizer_seconds(updated, dense if d > 1 else 0.0, hw.memory)
    step = pipeline + exposed_dp + optimizer
    tokens = args.global_batch_size * args.seq_length
    peak = W * hw.peak_flops * step
    return StepPrediction(
        compute=compute,
        bubble=pipeline - t_mb * m,
        exposed={**{d: t * m for d, t in per_mb.items()}, "dp": exposed_dp},
        step=step,
        bubble_fraction=bubble_fraction(pp, m, v),
        mfu=model_flops(args, vocab_size) / peak,
        hfu=hardware_flops(args, vocab_size) / peak,
        tokens_per_s_per_device=tokens / step / W,
        costs=costs + dp_costs,
        unfused=unfused * m,
        optimizer=optimizer,
        last_stage=head * m * (1 - 1 / pp),
    )


def _ring(
    args: PretrainArgs, layout: Layout, hw: Hardware, link: Link, layers: float
) -> tuple[float, list[Cost], float]:
    """One micro-batch's ring on this stage: the rounds' exposed seconds, the rounds as costs, and
    the engine's unfused passes (hardware with an elementwise figure, no fused attention). A K/V
    round is hidden under one ring step's attention (its blocks' FLOPs and unfused passes); the
    engine's gradient rounds are exposed (a fused ring hides them too)."""
    cp, fused = layout.cp, hw.flash_attention
    kv, grad = work.ring_round_bytes(args, layout, fused)
    passes = layers + recomputed_layers(args) / layout.pp  # recomputed blocks run the forward again
    rounds = [
        Cost("cp", "send", 2, kv, round((cp - 1) * (passes + layers)), link, "rounds"),
        Cost("cp", "send", 2, grad, round(cp * layers), link, "rounds"),
    ]
    c = args.seq_length / (2 * cp)
    d = args.kv_channels or args.hidden_size // args.num_attention_heads
    heads = args.num_attention_heads / layout.tp
    unfused = 0.0
    if hw.elementwise is not None and not fused:
        unfused = work.ring_unfused_seconds(layout.micro_batch_size, heads, c, d, cp, hw.elementwise)
    layer_flops = 14 * work.ring_blocks(cp)[0] * layout.micro_batch_size * heads * d * c**2
    step = (layer_flops / hw.achieved_flops + unfused) / (2 * cp)  # one ring step, forward or backward
    kv_s, grad_s = (collective_seconds("send", 2, b, link) for b in (kv, grad))
    grad_exposed = max(0.0, grad_s - step) if fused else grad_s
    exposed = rounds[0].count * max(0.0, kv_s - step) + rounds[1].count * grad_exposed
    return exposed, rounds, layers * unfused


def _data_parallel_costs(
    args: PretrainArgs, layout: Layout, hw: Hardware, n: float, distributed: bool, m: int
) -> list[Cost]:
    """The gradients' reduction over dp x cp: buckets (--ddp-bucket-size, Megatron's default) of fp32
    gradients (bf16 with --grad-reduce-in-bf16) all-reduced, or reduce-scattered and the half
    parameters all-gathered (distributed optimizer); FSDP: per micro-batch two all-gathers of the
    half parameters (forward, backward) and one reduce-scatter of fp32 gradients."""
    d = layout.dp * layout.cp
    if d == 1:
        return []
    link = group_link(layout.groups("dp", "cp"), hw)
    grad_bytes = 2 if args.grad_reduce_in_bf16 else 4
    param_bytes = 2 if (args.bf16 or args.fp16) else 4
    if args.use_torch_fsdp2:
        return [
            Cost("dp", "all_gather", d, n * param_bytes, 2 * m, link),
            Cost("dp", "reduce_scatter", d, n * grad_bytes, m, link),
        ]
    buckets = max(1, math.ceil(n / (args.ddp_bucket_size or default_bucket_size(d))))
    per = n / buckets
    if not distributed:
        return [Cost("dp", "all_reduce", d, per * grad_bytes, buckets, link)]
    return [
        Cost("dp", "reduce_scatter", d, per * grad_bytes, buckets, link),
        Cost("dp", "all_gather", d, per * param_bytes, buckets, link),
    ]
