"""The log-based checks of the layout exercises (notebooks 04, 05 and 09).

A run is right when its banner is that of the asked layout (world size = dp x tp x pp) and its
last iteration line was printed (``iteration n/ n``): the job trained to the end. Notebook 05's
pipelined run must also have the asked micro batch b and the fewest micro-batches per step m
with (p - 1)/(m + p - 1) <= the asked bubble, and its timeline must show the bubble measured
below the one-micro-batch bubble (p - 1)/p by more than :data:`BUBBLE_MARGIN`. Notebook 09's
long-sequence run must also stay within a memory budget per rank (its ``> memory:`` line) with
tensor parallelism inside a node.
"""

from __future__ import annotations

from pathlib import Path

from distlab.checks import FIXME, check
from distlab.gpt.pipeline_parallel.timeline import load_timeline, theoretical_bubble
from distlab.logs.formats import CONTEXT_PARALLEL
from distlab.logs.megatron import banner_line, batch_arithmetic, layout_and_completion, parse_banner
from distlab.logs.memory import prediction

BUBBLE_MARGIN = 0.08
"""How far below (p - 1)/p the measured bubble must fall. TP 2 x PP 2 on the local cluster's 2 shared
cores (4 iterations, micro batch 2) measured 0.51-0.54 at m = 1, 0.30-0.33 at m = 2 and 0.21-0.34 at
m = 8 (five runs, some beside other jobs): stage 1's logits make it the slower stage, and ranks
waiting for a core idle. The measurement cannot tell m = 2 from m = 8 here; the log's m can."""

HINT = (
    "world size = data-parallel x tensor-parallel x pipeline-parallel: with 2 nodes x 2 processes, "
    "TP and PP fix what is left for DP. If the layout is right but training did not finish, "
    "read the error lines of the job's log"
)


def check_layout_run(
    text: str | None, *, world_size: int, tp: int, pp: int, name: str = "the exercise run"
) -> bool:
    """``check`` the log ``text`` of a run (None: not submitted yet, reported as untouched)."""
    answer = FIXME if text is None else layout_and_completion(text)
    return check(name, answer, expected=(banner_line(world_size, tp, pp), True), hint=HINT)


def fewest_microbatches(p: int, max_bubble: float) -> int:
    """The smallest m with (p - 1)/(m + p - 1) <= ``max_bubble``."""
    m = 1
    while theoretical_bubble(p, m) > max_bubble + 1e-12:
        m += 1
    return m


def check_pipeline_run(
    text: str | None, timeline: str | Path | None, *, micro_batch: int, max_bubble: float
) -> bool:
    """``check`` notebook 05's pipelined run from its log ``text`` and its ``--pipeline-timeline``
    file (None: not submitted yet): micro batch ``micro_batch``, the fewest micro-batches per
    step whose bubble is at most ``max_bubble``, and a measured bubble that fell below (p - 1)/p
    by more than :data:`BUBBLE_MARGIN` in a timeline of those m micro-batches."""
    if text is None or timeline is None:
        return check("the pipelined run", FIXME, ok=bool)
    batch, p = batch_arithmetic(text), parse_banner(text).pp
    check(
        "micro batch",
        batch.get("micro_batch"),
        ok=lambda b: b == micro_batch,
        hint="the exercise says how many sequences' activations a GPU holds in one forward",
    )
    m = fewest_microbatches(p, max_bubble)
    check(
        "micro-batches per step",
        batch.get("accumulation"),
        ok=lambda a: a == m,
        hint=f"solve (p - 1)/(m + p - 1) <= {max_bubble:.3g} for the fewest m, with p = {p}; "
        "then global batch = micro batch x DP x m",
    )
    tl = load_timeline(timeline)
    limit = (p - 1) / p - BUBBLE_MARGIN
    return check(
        "measured bubble",
        round(tl["measured_bubble"], 3),
        ok=lambda b: tl["microbatches"] == m and b < limit,
        hint=f"the timeline {timeline} holds {tl['microbatches']} micro-batches per step (the log "
        f"{m}); a run of {m} measures its bubble below {limit:.2f}, far from one micro-batch's "
        f"(p - 1)/p: is the timeline this run's? Plot it",
    )


def long_sequence_run(text: str) -> dict:
    """What notebook 09's exercise reads from a run's log: world size, tp, cp, the sequence, the
    predicted peak per rank (MiB) and whether the run trained to its last iteration."""
    banner, done = parse_banner(text), layout_and_completion(text)[1]
    cp = CONTEXT_PARALLEL.search(text) or {"cp": 1}
    return {
        "world_size": banner.world_size,
        "tp": banner.tp,
        "cp": cp["cp"],
        "seq_length": cp.get("seq_length"),
        "predicted_mib": prediction(text).get("predicted"),
        "finished": done,
    }


def check_long_sequence_run(
    text: str | None, *, world_size: int, seq_length: int, budget_mib: float, max_tp: int
) -> bool:
    """``check`` notebook 09's run: ``world_size`` ranks, ``--seq-length`` ``seq_length`` (or cp = 1),
    a predicted peak per rank within ``budget_mib``, tp <= ``max_tp`` (inside a node), finished."""
    answer = FIXME if text is None else long_sequence_run(text)

    def ok(run: dict) -> bool:
        return (
            run["world_size"] == world_size
            and run["seq_length"] in (seq_length, None)
            and run["predicted_mib"] is not None
            and run["predicted_mib"] <= budget_mib
            and run["tp"] <= max_tp
            and run["finished"]
        )

    hint = (
        f"{world_size} ranks = tp x cp x dp (x pp); tensor parallelism at most {max_tp} (inside a node); "
        f"the predicted peak per rank (the '> memory:' line) at most {budget_mib} MiB: which dimension "
        f"divides every activation, the loss head's included, by its size? And did the run finish?"
    )
    return check("the long-sequence run", answer, ok=ok, hint=hint)
