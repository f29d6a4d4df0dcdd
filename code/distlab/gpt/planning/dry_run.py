"""A dry run at full size: one rank of an N-rank run, on the meta device, under a fake process group.

``pretrain_gpt.py ... --dry-run-world-size N --dry-run-rank R`` validates the arguments for a
world of N ranks (every layout check of a real run), joins PyTorch's fake process group
(``torch.testing._internal.distributed.fake_pg``: rank R of N, collectives that return at once,
as torchtitan's dry runs use it), builds the groups and rank R's stage and shard of the model on
the meta device (shapes, no storage: a 70B model costs what a tiny one does) and runs the step's
forward/backward, gradient reduction and norm on meta tensors, recording every collective
(``collectives.py``). Nothing is allocated or computed; what is printed is exact for this rank:

    coordinates      (dp, tp, pp, cp, ep) of rank R in Megatron's tp-cp-dp-pp order
    parameters       counted on the built shard
    model states     bytes per parameter as Megatron-LM's distributed-optimizer table gives them,
                     d the data-parallel size (dp x cp, the group the optimizer shards over):

                         parameters / main grads     plain DDP    --use-distributed-optimizer
                         fp32 / fp32                   16          8 + 8/d
                         fp16 / fp32                   20          4 + 16/d
                         bf16 / fp32                   18          6 + 12/d

    activations      the engine's estimator (``memory/memory_estimate.py``), first stage's peak
    predicted peak   the estimator's max(forward/backward, step) with the states above
    collectives      of one step, per group: operation, group size, bytes per call, count

With --bf16 or --fp16 the meta model is cast to the half dtype, as Megatron-LM keeps its weights
on the GPU (activations and pipeline messages travel in it, the messages in fp32 with
--fp32-residual-connection; without the distributed optimizer the engine itself computes under
autocast from fp32 weights). The step runs through the engine's own
back end (``LocalBackend``): the dp all-reduce of fp32 gradient buckets (Megatron's DDP), or with
--use-distributed-optimizer its reduce-scatters of the gradient buckets (fp32; fp16 with --fp16, bf16
with --grad-reduce-in-bf16, as Megatron's) and all-gathers of the parameters
(``optimizer/distrib_optimizer.py``); the norm's value, which meta tensors lack, ends
the step after its last reduction, and the distributed optimizer's all-gathers are started then.
Left out: the loss's mean (one fp32 scalar all-reduced over dp x
cp and broadcast over pp), whose value a dry run does not have. With experts (``--num-experts``)
the step is not run: the token routing splits tensors by counts computed from the values (the
all-to-all's splits), which meta tensors do not have; parameters and memory are still printed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.from_args import build_distributed_optimizer, build_optimizer
from distlab.gpt.arguments.to_configs import precision_config
from distlab.gpt.build import build_forward_backward, build_model
from distlab.gpt.data.tokenizers import TokenizerSpec
from distlab.gpt.interfaces import MicroBatch
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import MemoryEstimate, MemorySetup, activation_bytes, backward_moments
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.planning.collectives import Collective, record_collectives, summarize
from distlab.gpt.tensor_parallel.layers import pad_vocab_size
from distlab.gpt.training.training import LocalBackend, forward_backward
from distlab.log_line import LogLine

#: The lines of :meth:`DryRun.report`, per rank, which ``distlab.logs.planning`` reads back.
DRY_RUN = LogLine("> dry run: rank {rank:d} of {world_size:d} (fake process group, model on the meta device)")
DRY_RUN_PARAMETERS = LogLine("> parameters on this rank: {parameters:,d} ({precision})")
#: The model states and the predicted peak of the rank, GiB; ``how``: "without" or "with".
DRY_RUN_STATES = LogLine(
    ">   {params_gib:10.2f} {grads_gib:10.2f} {optim_gib:10.2f} {total_gib:7.2f} {peak_gib:8.2f}"
    "   {how} distributed optimizer"
)
DRY_RUN_ACTIVATIONS = LogLine(
    "> activations (estimator, {micro_batches:d} micro-batches): {activations_gib:.2f} GiB"
)
#: One kind of call of one step: ``count`` calls of ``op`` over ``group`` (``size`` ranks), GiB each
#: (the whole buffer, nccl-tests' size) and in all.
DRY_RUN_COLLECTIVE = LogLine(
    ">   collective  {group} {size:4d}  {op} {gib_per_call:12.6f} {count:7d} {gib:12.4f}"
)

GiB = 2**30
#: Bytes per parameter (parameters, gradients, optimizer) by precision, without and with the
#: distributed optimizer over d ranks (Megatron-LM's docs/source/api-guide/dist_optimizer table).
STATE_BYTES = {
    "fp32": ((4, 4, 8), lambda d: (4, 4, 8 / d)),
    "fp16": ((2, 2 + 4, 12), lambda d: (2, 2, (4 + 12) / d)),
    "bf16": ((2, 4, 12), lambda d: (2, 4, 12 / d)),
}


def precision_of(args: PretrainArgs) -> str:
    return "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"


def model_states(n: int, precision: str, d: int, distributed: bool) -> tuple[float, float, float]:
    """Bytes of (parameters, gradients, optimizer state) of ``n`` parameters (:data:`STATE_BYTES`)."""
    plain, sharded = STATE_BYTES[precision]
    per = sharded(d) if distributed else plain
    return tuple(n * b for b in per)


def megatron_peak(setup: MemorySetup, n: int, precision: str, distributed: bool) -> float:
    """The estimator's peak (``MemoryEstimate.peak``: max of the step and forward/backward, the
    gradients made by each moment of backward counted) with Megatron's model states of ``n``
    parameters in place of the engine's."""
    p, g, o = model_states(n, precision, setup.dp * setup.cp, distributed)
    with_grads = max(a + grads for a, grads in backward_moments(setup, g / n))
    estimate = MemoryEstimate(p, g, o, 0.0, activation_bytes(setup), with_grads)
    return estimate.peak(accumulating=setup.num_micro_batches > 1)


@dataclass
class DryRun:
    """What a dry run found for one rank (see the module docstring)."""

    rank: int
    layout: Layout
    coordinates: dict[str, int]
    parameters: int
    precision: str
    activations: float  # bytes, the estimator's
    setup: MemorySetup  # what the estimator was given
    num_micro_batches: int
    collectives: list[Collective] | None  # None with experts (see the module docstring)

    def states(self, distributed: bool) -> tuple[float, float, float]:
        d = self.layout.dp * self.layout.cp
        return model_states(self.parameters, self.precision, d, distributed)

    def per_parameter(self, distributed: bool) -> float:
        return sum(model_states(1, self.precision, self.layout.dp * self.layout.cp, distributed))

    def peak(self, distributed: bool) -> float:
        return megatron_peak(self.setup, self.parameters, self.precision, distributed)

    def report(self) -> list[str]:
        """The lines ``pretrain_gpt.py --dry-run-world-size`` prints, memory in GiB
        (:data:`DRY_RUN` and the ``DRY_RUN_*`` lines, which the notebooks' readers parse back)."""
        c, lay = self.coordinates, self.layout
        lines = [
            DRY_RUN.format(rank=self.rank, world_size=lay.world_size),
            "> coordinates: " + ", ".join(f"{k} {v}" for k, v in c.items())
            + f" (of dp {lay.dp}, tp {lay.tp}, pp {lay.pp}, cp {lay.cp}, ep {lay.ep})",
            DRY_RUN_PARAMETERS.format(parameters=self.parameters, precision=self.precision),
            f"> model states, bytes per parameter from Megatron-LM's distributed-optimizer table ({self.precision}, "
            f"d = dp x cp = {lay.dp * lay.cp}): {self.per_parameter(False):g} without, {self.per_parameter(True):.4g} with",
            ">   parameters  gradients  optimizer   total     peak   model states and predicted peak (+ activations), GiB",
        ]  # fmt: skip
        for distributed in (False, True):
            p, g, o = self.states(distributed)
            gib = dict(params_gib=p / GiB, grads_gib=g / GiB, optim_gib=o / GiB, total_gib=(p + g + o) / GiB)
            lines.append(
                DRY_RUN_STATES.format(
                    **gib, peak_gib=self.peak(distributed) / GiB, how="with" if distributed else "without"
                )
            )
        lines.append(
            DRY_RUN_ACTIVATIONS.format(
                micro_batches=self.num_micro_batches, activations_gib=self.activations / GiB
            )
        )
        if self.collectives is None:
            lines.append(
                "> collectives of one step: not recorded with --num-experts (routing needs the data's values)"
            )
            return lines
        lines.append(
            ">   collective  group      size  operation       GiB per call   count   GiB in all   (one step)"
        )
        for call, count in summarize(self.collectives):
            lines.append(
                DRY_RUN_COLLECTIVE.format(
                    group=f"{call.group:9s}",
                    size=call.size,
                    op=f"{call.op:15s}",
                    gib_per_call=call.nbytes / GiB,
                    count=count,
                    gib=call.nbytes * count / GiB,
                )  # fmt: skip
            )
        return lines


def check_dry_run_rank(world_size: int, rank: int) -> None:
    """--dry-run-world-size N needs N >= 1 and 0 <= --dry-run-rank < N."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"--dry-run-rank {rank} is not a rank of --dry-run-world-size {world_size}: give a rank "
            f"from 0 to {world_size - 1} (and a world size of at least 1)"
        )


def meta_batches(layout: Layout, seq_length: int, device: torch.device) -> list[MicroBatch]:
    """This rank's m micro-batches of token ids and labels, (b, T / cp) each, on ``device``."""
    shape = (layout.micro_batch_size, seq_length // layout.cp)
    return [
        (torch.zeros(shape, dtype=torch.long, device=device),) * 2 for _ in range(layout.num_micro_batches)
    ]


def step_collectives(
    args: PretrainArgs, state: ParallelState, model, batches: list[MicroBatch]
) -> list[Collective]:
    """One training step of ``batches`` through the engine's own back end (``LocalBackend``:
    forward/backward, the gradients' reduction in dp buckets or, with --use-distributed-optimizer,
    its reduce-scatters, the norm, the step and its all-gathers), recording the collectives. The
    same on meta tensors under a fake group (a dry run) and on real ones (its test)."""
    device = batches[0][0].device
    dtype = next(model.parameters()).dtype
    messages = precision_config(args).residual_dtype  # the residual stream's dtype
    run = build_forward_backward(args, state, device, None, messages) if state.pp > 1 else forward_backward
    if args.use_distributed_optimizer:
        optimizer = build_distributed_optimizer(model, state, args, dtype)
    else:
        optimizer = build_optimizer(model, args)
    # Megatron's DDP reduces its fp32 main grads (--grad-reduce-in-bf16: in bf16), whatever the weights' dtype
    reduce_dtype = torch.bfloat16 if args.grad_reduce_in_bf16 else torch.float32
    backend = LocalBackend(model, optimizer, state, clip_grad=args.clip_grad, bucket_size=args.ddp_bucket_size,
                           overlap_grad_reduce=args.overlap_grad_reduce, reduce_dtype=reduce_dtype)  # fmt: skip
    with record_collectives(state) as calls:
        backend.zero_grad()
        run(model, batches, backward=backend.backward, grad_sync=backend.set_grad_sync)
        try:
            backend.step()
        except (RuntimeError, NotImplementedError):
            if not device.type == "meta":
                raise
            # meta: the norm has no value to test (float(norm)), after every reduction was issued;
            # what the step would do next is the distributed optimizer's all-gather
            if args.use_distributed_optimizer:
                optimizer.buffer.start_param_sync()
    return calls


def dry_run(args: PretrainArgs, layout: Layout, rank: int) -> DryRun:
    """Rank ``rank`` of ``layout`` on the meta device under a fake process group (initialised here,
    destroyed after): see the module docstring. ``args`` were validated for ``layout.world_size``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    meta = torch.device("meta")
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        state = ParallelState.build(layout)
        vocab = pad_vocab_size(
            TokenizerSpec.from_args(args).build().vocab_size, args.make_vocab_size_divisible_by, state.tp
        )
        precision = precision_of(args)
        with torch.device(meta):
            model = build_model(args, state, vocab, meta)
        if precision != "fp32":
            model = model.to(torch.float16 if precision == "fp16" else torch.bfloat16)
        calls = None  # experts route by the data's values, which meta tensors do not have
        if args.num_experts is None:
            calls = step_collectives(args, state, model, meta_batches(layout, args.seq_length, meta))
        setup = MemorySetup.from_run(args, layout, vocab)
        coords = {d: state.layout.coord(rank, d) for d in ("dp", "tp", "pp", "cp")}
        coords["ep"] = state.ep_rank if layout.ep > 1 else 0
        return DryRun(
            rank=rank,
            layout=layout,
            coordinates=coords,
            parameters=sum(p.numel() for p in model.parameters()),
            precision=precision,
            activations=activation_bytes(setup),
            setup=setup,
            num_micro_batches=layout.num_micro_batches,
            collectives=calls,
        )
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
