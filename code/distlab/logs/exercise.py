"""The log-based checks of the layout exercises (notebooks 04, 05 and 09).

A run is right when its banner is that of the asked layout (world size = dp x tp x pp) and its
last iteration line was printed (``iteration n/ n``): the job trained to the end. Notebook 09's
long-sequence run must also stay within a memory budget per rank (its ``> memory:`` line) with
tensor parallelism inside a node.
"""

from __future__ import annotations

from distlab.checks import FIXME, check
from distlab.logs.formats import CONTEXT_PARALLEL
from distlab.logs.megatron import banner_line, layout_and_completion, parse_banner
from distlab.logs.memory import prediction

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
