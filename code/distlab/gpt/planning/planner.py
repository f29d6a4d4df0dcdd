"""Plan a run: the layouts of a model on a cluster that fit in memory, ranked by predicted step time.

Candidates, in the Ultra-Scale Playbook's order of concerns: tp a power of two up to the GPUs of
one node, with sequence parallelism; pp, with v chunks per stage (interleaved 1F1B); cp a power of
two; dp what is left. Each is checked by the engine itself (``validate_args``: the layout's rules,
``model_layout.py``'s rules of the model against it, and every flag's, so that no layout the engine
refuses is ranked; the refused ones keep its message) and by the estimator (``memory/memory_estimate.py``: the first stage's activations
under its schedule) with Megatron's model-state bytes (``dry_run.STATE_BYTES``), and timed by
``step_model.predict_step``. A layout that does not fit names the state that overflows (the
largest one of its peak) and by how much the peak exceeds the device's memory.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from dataclasses import dataclass

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.validation import engine_layout
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import MemorySetup, activation_bytes, stage_parameters
from distlab.gpt.planning.dry_run import GiB, megatron_peak, model_states, precision_of
from distlab.gpt.planning.hardware import Hardware
from distlab.gpt.planning.step_model import StepPrediction, predict_step
from distlab.gpt.planning.utilization import HFU_CONVENTION, MFU_CONVENTION
from distlab.gpt.tensor_parallel.layers import pad_vocab_size


@dataclass
class Candidate:
    """One layout, its memory (bytes by state, peak) and, if it fits, its predicted step."""

    layout: Layout
    states: dict[str, float]  # parameters, gradients, optimizer, activations
    peak: float
    budget: float
    prediction: StepPrediction | None = None

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget

    def name(self) -> str:
        lay = self.layout
        v = f" v {lay.vp}" if lay.vp > 1 else ""
        return f"tp {lay.tp} pp {lay.pp}{v} cp {lay.cp} dp {lay.dp} b {lay.micro_batch_size} m {lay.num_micro_batches}"

    def why(self) -> str:
        """Bubble, the last stage's extra work, exposed communication and memory headroom (fits) or
        what overflows (does not)."""
        if not self.fits:
            state, size = max(self.states.items(), key=lambda kv: kv[1])
            return (
                f"does not fit: peak {self.peak / GiB:.1f} GiB exceeds {self.budget / GiB:.0f} GiB by "
                f"{(self.peak - self.budget) / GiB:.1f} GiB; largest state: {state} {size / GiB:.1f} GiB"
            )
        p = self.prediction
        comm = {k: v for k, v in p.exposed.items() if v > 0}
        exposed = ", ".join(f"{k} {v:.2f} s" for k, v in comm.items()) or "none"
        last = f"last stage's output layer +{p.last_stage:.2f} s, " if p.last_stage > 0 else ""
        return (
            f"bubble {100 * p.bubble_fraction:.0f}% ({p.bubble:.2f} s), {last}exposed communication {exposed}, "
            f"memory headroom {(self.budget - self.peak) / GiB:.1f} GiB of {self.budget / GiB:.0f}"
        )


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


@dataclass(frozen=True)
class Refused:
    """A layout of the search that the engine's ``validate_args`` refuses, and its message."""

    name: str
    why: str


def sized(args: PretrainArgs, *, tp: int, pp: int, cp: int = 1, micro_batch_size: int, vp: int = 1,
          distributed_optimizer: bool | None = None) -> PretrainArgs:  # fmt: skip
    """A copy of ``args`` with these sizes (and sequence parallelism exactly when tp > 1), as a
    user would launch it."""
    return dataclasses.replace(
        copy.deepcopy(args),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        micro_batch_size=micro_batch_size,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        num_layers_per_virtual_pipeline_stage=None,
        sequence_parallel=tp > 1,
        use_distributed_optimizer=(
            args.use_distributed_optimizer if distributed_optimizer is None else distributed_optimizer
        ),
    )


def candidate_layouts(
    args: PretrainArgs, world: int, hw: Hardware, micro_batch_sizes=(1, 2),
    distributed_optimizer: bool = True, refused: list[Refused] | None = None,
) -> list[Layout]:  # fmt: skip
    """Every layout of ``world`` ranks in the search (tp a power of two within a node, pp, cp a
    power of two, v in 1, 2, 4; the global batch is args') that the engine accepts; those it
    refuses are appended to ``refused`` with the engine's message."""
    out = []
    tps = _powers_of_two(hw.gpus_per_node)
    pps = [p for p in range(1, args.num_layers + 1) if world % p == 0]
    for tp, pp, cp, b in itertools.product(tps, pps, _powers_of_two(world), micro_batch_sizes):
        if world % (tp * pp * cp):
            continue  # not a factoring of the world
        for v in [1, 2, 4] if pp > 1 else [1]:
            run = sized(args, tp=tp, pp=pp, cp=cp, micro_batch_size=b, vp=v,
                        distributed_optimizer=distributed_optimizer)  # fmt: skip
            found = engine_layout(run, world)
            if isinstance(found, Layout):
                out.append(found)
            elif refused is not None:
                name = f"tp {tp} pp {pp}{f' v {v}' if v > 1 else ''} cp {cp} b {b}"
                refused.append(Refused(name, found))
    return out


def evaluate(
    args: PretrainArgs, layout: Layout, hw: Hardware, distributed_optimizer: bool = True
) -> Candidate:
    """Memory of the first stage's rank (estimator + Megatron's state bytes) and, if it fits, its step."""
    vocab = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, layout.tp)
    run = dataclasses.replace(args, micro_batch_size=layout.micro_batch_size)
    setup = MemorySetup.from_run(run, layout, vocab)
    n = stage_parameters(setup)
    p, g, o = model_states(n, precision_of(args), layout.dp * layout.cp, distributed_optimizer)
    states = {"parameters": p, "gradients": g, "optimizer state": o, "activations": activation_bytes(setup)}
    peak = megatron_peak(setup, n, precision_of(args), distributed_optimizer)
    found = Candidate(layout, states, peak, hw.memory_bytes)
    if found.fits:
        found.prediction = predict_step(
            run, layout, hw, vocab, n, distributed_optimizer=distributed_optimizer
        )
    return found


def plan(
    args: PretrainArgs, world: int, hw: Hardware, distributed_optimizer: bool = True,
    refused: list[Refused] | None = None,
) -> list[Candidate]:  # fmt: skip
    """Every candidate the engine accepts: those that fit first, fastest first; then the others,
    smallest overflow first (the refused ones, if ``refused`` is given, appended to it)."""
    layouts = candidate_layouts(args, world, hw, distributed_optimizer=distributed_optimizer, refused=refused)
    found = [evaluate(args, lay, hw, distributed_optimizer) for lay in layouts]
    fit = sorted((c for c in found if c.fits), key=lambda c: c.prediction.step)
    over = sorted((c for c in found if not c.fits), key=lambda c: c.peak)
    return fit + over


def refusal_kinds(refused: list[Refused]) -> dict[str, list[Refused]]:
    """The refused layouts grouped by the engine's reason, its numbers masked (N), most first."""
    kinds: dict[str, list[Refused]] = {}
    for r in refused:
        reason = r.why.removeprefix("invalid arguments: ")
        kinds.setdefault(re.sub(r"\d+", "N", reason.split(": ")[0]), []).append(r)
    return dict(sorted(kinds.items(), key=lambda kv: -len(kv[1])))


def report(candidates: list[Candidate], top: int = 5, refused: list[Refused] = ()) -> list[str]:
    """The best ``top`` layouts with MFU, HFU and why, then the nearest layouts that do not fit,
    then (if given) how many the engine refuses for each reason, with one example's message."""
    fit = [c for c in candidates if c.fits]
    lines = [f"> {len(fit)} of {len(candidates)} runnable layouts fit; the best {min(top, len(fit))}:"]
    for c in fit[:top]:
        p = c.prediction
        lines.append(
            f">   {c.name():38s} step {p.step:8.2f} s  MFU {100 * p.mfu:4.1f}%  HFU {100 * p.hfu:4.1f}%  {c.why()}"
        )
    lines.append(f">   ({MFU_CONVENTION}; {HFU_CONVENTION})")
    for c in [c for c in candidates if not c.fits][:3]:
        lines.append(f">   {c.name():38s} {c.why()}")
    if refused:
        lines.append(f"> {len(refused)} layouts of the search are refused by the engine's validate_args:")
        for same in refusal_kinds(refused).values():
            example = same[0].why.removeprefix("invalid arguments: ")
            lines.append(f">   {len(same):4d} like {same[0].name}: {example}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m distlab.gpt.planning.planner --world-size 256 [--hardware h100_sxm_node]
    [--no-distributed-optimizer] -- <pretrain_gpt.py's model and batch flags>``: the best five."""
    import argparse
    import sys

    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m distlab.gpt.planning.planner", description=main.__doc__)
    parser.add_argument("--world-size", type=int, required=True, help="devices of the cluster")
    parser.add_argument(
        "--hardware", default="h100_sxm_node", help="a file of planning/machines/ or a JSON path"
    )
    parser.add_argument("--no-distributed-optimizer", action="store_true", help="Megatron's plain DDP states")
    opts = parser.parse_args(argv[:split])
    from distlab.gpt.arguments import parse_args
    from distlab.gpt.planning.hardware import load

    args, hw = parse_args(argv[split + 1 :]), load(opts.hardware)
    print(
        f"> {hw.name}: {opts.world_size} devices; global batch {args.global_batch_size} x {args.seq_length} tokens"
    )
    refused: list[Refused] = []
    found = plan(args, opts.world_size, hw, not opts.no_distributed_optimizer, refused)
    print("\n".join(report(found, refused=refused)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
