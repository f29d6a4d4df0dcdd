"""Notebook 05's hybrid exercise, by constraint: TP, PP, micro and global batch chosen from limits.

The learner sees the cluster (:data:`NODES` nodes x ``procs`` ranks, a network between the nodes
much slower than the links inside one), the model (the notebook's GPT) and three limits
(:func:`describe`), and chooses the tensor- and pipeline-parallel sizes, the micro batch and the
global batch:

* memory: at most :func:`max_parameters` parameters on any rank (the run prints each model-parallel
  rank's count: ``> number of parameters on (tensor, pipeline) model parallel rank``);
* activations: a forward holds at most :data:`MAX_MICRO` sequences (the micro batch), the largest
  that fits to be taken;
* the pipeline bubble, (p - 1)/(m + p - 1) of the step, at most :data:`MAX_BUBBLE`;

and, within them, the smallest global batch. The parameter limit lies halfway between what a rank
holds with the whole node's ranks in a tensor-parallel group and two pipeline stages (the most
split layout that keeps tensor parallelism inside a node and the fewest stages) and the least any
layout holds with two data-parallel replicas or more, tp inside a node: so no layout with dp > 1
fits, and among those that do (tp inside a node) the fewest stages need the fewest micro-batches.
On the local cluster (2 x 2, 4 layers, hidden 64) that leaves TP 2 x PP 2, DP 1, micro 2, m 8.

:func:`check_run` reads the run's log (``distlab.logs.megatron``'s readers): the cluster's ranks,
training to the last iteration, tp inside a node, every rank's parameters within the limit, the
smallest global batch of any layout within the limits; then ``distlab.logs.exercise``'s
:func:`~distlab.logs.exercise.check_pipeline_run` (the micro batch, the fewest micro-batches per
step for the bubble, the run's own timeline). The per-layout counts stay in here: the notebook
shows the limits only. A wrong choice is told which limit it misses, without the layout.
"""

from __future__ import annotations

import math
from pathlib import Path

from distlab.checks import FIXME, check
from distlab.course import VOCAB_SIZE, ModelShape
from distlab.gpt.memory.parameters import stage_parameters
from distlab.gpt.memory.setup import MemorySetup
from distlab.gpt.tensor_parallel.layers import pad_vocab_size
from distlab.logs.exercise import check_pipeline_run, fewest_microbatches
from distlab.logs.megatron import batch_arithmetic, layout_and_completion, parameter_counts, parse_banner

NAME = "the two-node hybrid layout within the limits"
NODES = 2
MAX_MICRO = 2  # sequences whose activations one forward may hold
MAX_BUBBLE = 1 / 9  # of the step

FINISHED_HINT = (
    "The run did not train to its last iteration (or did not start): read the error lines of the job's log."
)
WORLD_HINT = "Use every rank of the cluster: {nodes} nodes x {procs}; world size = TP x PP x DP."
CROSS_HINT = (
    "Tensor parallelism of size {tp} on nodes of {procs} ranks: Megatron's rank order puts a TP group's "
    "ranks next to each other, so a group of {tp} spans ranks of both nodes, and its all-reduces, "
    "several per layer and micro-batch on the critical path, would cross the slow network."
)
MEMORY_HINT = (
    "Rank (tp {tp_rank}, pp {pp_rank}) holds {parameters:,} parameters, above the limit of {limit:,}. "
    "Count what a rank holds: its stage's layers, split by TP, and on the first stage the embeddings "
    "(V h / TP + s h), on the last the output layer: what divides each?"
)
GLOBAL_HINT = (
    "Your layout stays within the limits, but another one does too and reaches the bubble limit with fewer "
    "sequences per step (global batch = micro x DP x m). The bubble (p - 1)/(m + p - 1) grows with the "
    "number of stages p, and every data-parallel replica multiplies the global batch."
)


def rank_parameters(model: ModelShape, tp: int, pp: int, vocab_size: int = VOCAB_SIZE) -> int | None:
    """The most parameters any rank holds (the first stage: its layers and the embeddings, whose
    positions outweigh the last stage's final norm) for ``model`` split tp x pp; None for a split
    the engine refuses (heads or layers that tp or pp does not divide)."""
    try:
        setup = MemorySetup(
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_attention_heads=model.num_attention_heads,
            seq_length=model.seq_length,
            vocab_size=pad_vocab_size(vocab_size, 128, tp),
            micro_batch_size=1,
            tp=tp,
            pp=pp,
        )
    except ValueError:
        return None
    return stage_parameters(setup)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: ModelShape, procs: int, vocab_size: int = VOCAB_SIZE) -> dict[tuple[int, int], int]:
    """(tp, pp) -> the most parameters a rank holds, for every split of the cluster's ranks the
    engine runs with tp inside a node (tp divides ``procs``)."""
    world = NODES * procs
    out = {}
    for tp in _divisors(procs):
        for pp in _divisors(world // tp):
            n = rank_parameters(model, tp, pp, vocab_size)
            if n is not None:
                out[tp, pp] = n
    return out


def max_parameters(model: ModelShape, procs: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The limit: halfway between a rank's parameters at tp = ``procs`` x pp = 2 and the fewest of any
    layout with dp > 1 (tp inside a node), rounded to three significant digits."""
    world, split = NODES * procs, layouts(model, procs, vocab_size)
    low = split.get((procs, NODES))
    high = min((n for (tp, pp), n in split.items() if tp * pp < world), default=None)
    if low is None or high is None or low >= high:
        raise ValueError(f"no parameter limit separates tp {procs} x pp {NODES} from dp > 1 for {model}")
    mid = (low + high) / 2
    digits = 3 - int(math.floor(math.log10(mid))) - 1
    limit = int(round(mid, digits))
    return limit if low < limit < high else int(mid)


def global_batch(pp: int, dp: int) -> int:
    """The smallest global batch of a layout: the largest micro batch, the fewest micro-batches per
    step whose bubble is at most :data:`MAX_BUBBLE`."""
    return MAX_MICRO * dp * fewest_microbatches(pp, MAX_BUBBLE)


def answers(model: ModelShape, procs: int, vocab_size: int = VOCAB_SIZE) -> dict[tuple[int, int], int]:
    """(tp, pp) -> global batch of every right answer: the layouts within the limit (tp inside a
    node) with the smallest global batch."""
    world, limit = NODES * procs, max_parameters(model, procs, vocab_size)
    fits = {(tp, pp): global_batch(pp, world // (tp * pp)) for (tp, pp), n in layouts(model, procs, vocab_size).items()
            if n <= limit}  # fmt: skip
    best = min(fits.values())
    return {k: g for k, g in fits.items() if g == best}


def whole_model(model: ModelShape, vocab_size: int = VOCAB_SIZE) -> int:
    """Parameters of the whole model (one rank, one stage: the final norm included)."""
    return rank_parameters(model, 1, 1, vocab_size)


def describe(model: ModelShape, procs: int, vocab_size: int = VOCAB_SIZE) -> str:
    """What the learner is given: the cluster, the model and the limits (not the layouts' counts)."""
    limit = max_parameters(model, procs, vocab_size)
    return (
        f"cluster: {NODES} nodes x {procs} ranks; fast links within a node, a network ~10x slower between nodes\n"
        f"model:   {model.num_layers} layers, hidden {model.hidden_size}, {model.num_attention_heads} heads, "
        f"sequence {model.seq_length}, vocabulary {vocab_size:,}: {whole_model(model, vocab_size):,} parameters\n"
        f"limits:  at most {limit:,} parameters on any rank; at most {MAX_MICRO} sequences per forward; "
        f"a pipeline bubble of at most 1/{round(1 / MAX_BUBBLE)} of the step\n"
        "choose:  TP, PP, the micro batch (the largest within the limits) and the smallest global batch"
    )


def judge(text: str, model: ModelShape, procs: int, vocab_size: int = VOCAB_SIZE) -> tuple[str, bool, str]:
    """(what to show, right?, hint) of the layout of the run whose log is ``text``."""
    banner_line, finished = layout_and_completion(text)
    if not finished:
        return f"{banner_line}; not trained to the last iteration", False, FINISHED_HINT
    banner, batch = parse_banner(text), batch_arithmetic(text)
    tp, pp, world = banner.tp, banner.pp, NODES * procs
    said = f"TP {tp} x PP {pp} x DP {banner.dp}, global batch {batch.get('global_batch')}"
    if banner.world_size != world:
        return said + f" on {banner.world_size} ranks", False, WORLD_HINT.format(nodes=NODES, procs=procs)
    if tp > procs or procs % tp:
        return said, False, CROSS_HINT.format(tp=tp, procs=procs)
    limit = max_parameters(model, procs, vocab_size)
    counts = parameter_counts(text)
    (tp_rank, pp_rank), most = max(counts.items(), key=lambda kv: kv[1], default=((0, 0), 0))
    if most > limit:
        hint = MEMORY_HINT.format(tp_rank=tp_rank, pp_rank=pp_rank, parameters=most, limit=limit)
        return said, False, hint
    if (tp, pp) not in answers(model, procs, vocab_size):
        return said, False, GLOBAL_HINT
    return f"{said}; at most {most:,} parameters per rank (limit {limit:,}), TP inside a node", True, ""


def check_run(
    text: str | None,
    timeline: str | Path | None,
    *,
    model: ModelShape,
    procs: int,
    vocab_size: int = VOCAB_SIZE,
    name: str = NAME,
) -> bool:
    """``check`` the exercise's run from its log ``text`` and its ``--pipeline-timeline`` file
    (None: not run yet, "not yet"): the layout within the limits (:func:`judge`), then the micro
    batch, the micro-batches per step and the timeline (``check_pipeline_run``)."""
    if text is None:
        return check(name, FIXME, ok=bool)
    said, right, hint = judge(text, model, procs, vocab_size)
    check(name, said, ok=lambda _: right, hint=hint)
    return check_pipeline_run(text, timeline, micro_batch=MAX_MICRO, max_bubble=MAX_BUBBLE)


__all__ = [
    "answers",
    "check_run",
    "describe",
    "judge",
    "layouts",
    "max_parameters",
    "rank_parameters",
    "whole_model",
]
