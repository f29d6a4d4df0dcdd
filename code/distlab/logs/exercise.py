"""The log-based check of the layout exercises (notebooks 04 and 05).

A run is right when its banner is that of the asked layout (world size = dp x tp x pp) and its
last iteration line was printed (``iteration n/ n``): the job trained to the end.
"""

from __future__ import annotations

from distlab.checks import FIXME, check
from distlab.logs.megatron import banner_line, layout_and_completion

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
