"""Whole-run equivalence: every (TP, PP, DP) layout trains the same model as one process.

A tiny GPT (4 layers, hidden 32, 4 heads, sequence 16, vocabulary 512, global batch 8 of
micro-batches of 2) trains 3 iterations in fp32 with a fixed seed. The losses, gradient norms
and the validation loss of every layout, with both pipeline schedules, must match the
single-process run to ``rtol = atol = 1e-6``: every layout computes the same sums in a different
order (partial matmuls all-reduced, micro-batches accumulated), so only fp32 round-off
(~1e-7 relative per operation, a little amplified by three Adam steps) may differ.

Two spawned groups run everything (spawning costs seconds on 2 cores): world 2 also runs
the single-process reference on its rank 0, world 4 the layouts with 4 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distlab.gpt.pipeline_parallel.plot import plot_timelines
from distlab.gpt.pipeline_parallel.timeline import load_timeline
from distlab.local_ranks import free_port, spawn_ranks
from distlab.local_runs import prepare_data, pretrain_as_rank
from tests.conftest import TINY_GPT_ARGV as MODEL
from tests.conftest import assert_same_training

pytestmark = pytest.mark.timeout(420)

RTOL = 1e-6  # rtol = atol
#: (tp, pp, dp, schedule) for world 2 and world 4; the reference is (1, 1, 1).
LAYOUTS = {
    2: [(2, 1, 1, "1f1b"), (1, 2, 1, "gpipe"), (1, 2, 1, "1f1b"), (1, 1, 2, "1f1b")],
    4: [(2, 2, 1, "gpipe"), (2, 2, 1, "1f1b"), (2, 1, 2, "1f1b"), (1, 2, 2, "gpipe"), (1, 2, 2, "1f1b")],
}


def _name(tp: int, pp: int, dp: int, schedule: str) -> str:
    return f"tp{tp}-pp{pp}-dp{dp}-{schedule}"


def _argv(data: list[str], tp: int, pp: int, schedule: str) -> list[str]:
    return [
        *MODEL,
        *data,
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--pipeline-schedule",
        schedule,
    ]


def _run(rank: int, world: int, argv: list[str], port: int, out: Path, name: str) -> None:
    history = pretrain_as_rank(rank, world, port, argv, out / f"{name}.rank{rank}.log")
    history["log"] = (out / f"{name}.rank{rank}.log").read_text()
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(history))


def _worker(rank: int, world: int, runs: list, out: str) -> None:
    torch.set_num_threads(1)
    for argv, port, name, ranks in runs:
        if rank < ranks:  # the world-1 reference runs on rank 0 alone
            _run(rank, ranks, argv, port, Path(out), name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Run the reference and every layout once; return the folder of per-rank histories."""
    base = tmp_path_factory.mktemp("gpt_equivalence")
    data = prepare_data(base / "data", vocab_size=512, max_files=40).argv()
    for world, layouts in LAYOUTS.items():
        plan = []
        for tp, pp, dp, sched in layouts:
            argv = _argv(data, tp, pp, sched)
            if (tp, pp, dp) == (1, 2, 1):  # the timeline is recorded by the same runs (it must not perturb)
                argv += ["--pipeline-timeline", str(base / f"timeline-{sched}.json")]
            plan.append((argv, free_port(), _name(tp, pp, dp, sched), world))
        if world == 2:
            plan.insert(0, (_argv(data, 1, 1, "1f1b"), free_port(), "reference", 1))
        spawn_ranks(_worker, (world, plan, str(base)), world)
    return base


def _history(folder: Path, name: str, rank: int) -> dict:
    return json.loads((folder / f"{name}.rank{rank}.json").read_text())


@pytest.mark.parametrize(
    "tp,pp,dp,schedule", [lay for lays in LAYOUTS.values() for lay in lays], ids=lambda v: str(v)
)
def test_layout_matches_single_process(runs: Path, tp: int, pp: int, dp: int, schedule: str) -> None:
    ref = _history(runs, "reference", 0)
    world = tp * pp * dp
    last = _history(runs, _name(tp, pp, dp, schedule), world - 1)  # Megatron logs from the last rank
    what = f"(TP, PP, DP) = ({tp}, {pp}, {dp}) {schedule}"
    assert len(last["losses"]) == 3
    assert_same_training(last, ref, what, tol=RTOL)
    # The last rank prints the iteration lines, with the last stage's loss in them.
    lines = [ln for ln in last["log"].splitlines() if " lm loss: " in ln and "iteration" in ln]
    assert len(lines) == 3, last["log"]
    assert float(lines[-1].split(" lm loss: ")[1].split(" |")[0]) == pytest.approx(
        ref["losses"][-1], rel=1e-5
    )
    first = _history(runs, _name(tp, pp, dp, schedule), 0)["log"]
    assert (
        f"using world size: {world}, data-parallel-size: {dp}, tensor-model-parallel size: {tp}, "
        f"pipeline-model-parallel size: {pp}"
    ) in first
    assert "memory (MiB): parameters" in first  # the per-rank report after iteration 1
    if pp > 1:
        assert f"> pipeline schedule {schedule}: {pp} stages" in first


def test_timelines_of_a_real_run(runs: Path) -> None:
    """Both schedules' timelines of the (1, 2, 1) runs: every F and B recorded, plotted together."""
    paths = [runs / "timeline-gpipe.json", runs / "timeline-1f1b.json"]
    for path in paths:
        tl = load_timeline(path)
        assert (tl["stages"], tl["microbatches"], tl["iteration"]) == (2, 4, 3)
        assert sorted((e["stage"], e["kind"], e["mb"]) for e in tl["events"]) == sorted(
            (s, k, i) for s in range(2) for k in "FB" for i in range(4)
        )
        assert tl["theoretical_bubble"] == pytest.approx(1 / 5)
    plot_timelines(paths, runs / "timelines.png")
    assert (runs / "timelines.png").stat().st_size > 10_000


def test_reference_learns(runs: Path) -> None:
    """Guard against a vacuous comparison: the reference's loss moves and is near log(V) at start."""
    losses = _history(runs, "reference", 0)["losses"]
    assert abs(losses[0] - torch.log(torch.tensor(512.0)).item()) < 0.5
    assert losses[-1] < losses[0]
