"""Notebook 05's hybrid exercise by constraint (``distlab.exercises.hybrid_layout``): the learner sees
the cluster, the model and the limits, never each layout's parameters, and chooses the layout.

The limits leave one answer on the local cluster (TP 2 x PP 2, micro 2, global 16) and on GPU sites
of 2, 4 or 8 GPUs per node (TP = the node, PP 2); the parameters each layout puts on a rank are
exactly the engine's (a dry run of every rank on the meta device). The notebook's cells run here: the
limits cell prints no per-layout count; the check cell waits for a run, passes the solution's run and
fails wrong ones (TP across the nodes, a layout over the memory limit, one within it but with a
larger global batch, the wrong micro batch or m, a run that did not finish, too few ranks) with a
hint that names neither the layout nor the global batch. Logs are built from the engine's own line
formats, timelines as ``--pipeline-timeline`` writes them.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import time
from types import SimpleNamespace

import pytest

from distlab import REPO_ROOT
from distlab.checks import ExerciseError
from distlab.course import ModelShape
from distlab.exercises import hybrid_layout
from distlab.gpt.build import BATCH, PARAMETERS
from distlab.gpt.training.log import ITERATION
from distlab.logs.megatron import banner_line

NOTEBOOK = REPO_ROOT / "notebooks" / "05_tensor_pipeline_parallel.ipynb"
SOLUTION = REPO_ROOT / "solutions" / "05_tensor_pipeline_parallel_solution.ipynb"
LOCAL = ModelShape(4, 64, 4, 64)  # course.SIZES["05"]: the local cluster's model, 2 x 2 ranks
GPU = ModelShape(8, 1024, 16, 1024)  # a GPU site's
#: What a hint must not say on the local cluster: the layout or the global batch.
ANSWER = re.compile(
    r"TP 2|TP = 2|TP_SIZE=2|PP 2|PP = 2|PP_SIZE=2|tp 2 x|\b16\b|inside each node|across the two nodes"
)


def cells(path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]


def run_log(
    tp: int,
    pp: int,
    *,
    world: int = 4,
    micro: int = 2,
    m: int = 8,
    last_it: int = 4,
    model: ModelShape = LOCAL,
) -> str:
    """A run's log in the engine's formats: banner, batch line, each model-parallel rank's parameters
    (the first stage's count from hybrid_layout, the others a little less), iterations."""
    dp = world // (tp * pp)
    first = hybrid_layout.rank_parameters(model, tp, pp)
    lines = [
        banner_line(world, tp, pp),
        BATCH.format(global_batch=micro * dp * m, micro_batch=micro, dp=dp, accumulation=m),
    ]
    lines += [
        PARAMETERS.format(tp_rank=t, pp_rank=s, parameters=first - 100 * s)
        for s in range(pp)
        for t in range(tp)
    ]
    gbs = micro * dp * m
    for it in range(1, last_it + 1):
        lines.append(ITERATION.format(it=it, total=4, samples=it * gbs, ms=900.0, lr=1e-3, gbs=gbs, loss=8.1,
                                      scale=1.0, gnorm=1.0, skipped=0, nan=0))  # fmt: skip
    return "\n".join(lines) + "\n"


def timeline(path, stages: int, m: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schedule": "1f1b", "stages": stages, "microbatches": m, "chunks": 1, "events": [],
                                "measured_bubble": 0.3, "theoretical_bubble": (stages - 1) / (m + stages - 1)}))  # fmt: skip
    return path


def run_check_cell(tmp_path, monkeypatch, log: str | None, stages: int = 2, m: int = 8) -> tuple[bool, str]:
    """The notebook's check cell on the local cluster (2 x 2), in a folder holding the run's timeline."""
    monkeypatch.chdir(tmp_path)
    timeline(tmp_path / "jobs" / "gpt-hybrid-timeline.json", stages, m)
    source = next(c for c in cells(NOTEBOOK) if c.startswith("hybrid_layout.check_run("))
    job = None if log is None else SimpleNamespace(log=lambda: log)
    namespace = {
        "hybrid_layout": hybrid_layout,
        "hybrid": job,
        "LAB": SimpleNamespace(model=LOCAL),
        "PROCS": 2,
    }
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(f"result = {source}", namespace)
    return namespace["result"], out.getvalue()


def test_the_limits_leave_one_answer():
    assert hybrid_layout.max_parameters(LOCAL, 2) == 211_000
    assert hybrid_layout.answers(LOCAL, 2) == {(2, 2): 16}
    fits = {k for k, n in hybrid_layout.layouts(LOCAL, 2).items() if n <= 211_000}
    assert fits == {(2, 2)}  # TP 4 (across the nodes) would fit too: only the node boundary rules it out
    assert hybrid_layout.rank_parameters(LOCAL, 4, 1) <= 211_000
    for procs in (2, 4, 8):
        assert hybrid_layout.answers(GPU, procs) == {(procs, 2): 16}, procs


def test_the_layouts_count_what_the_engine_builds():
    """Every rank of every local layout, built by a dry run (meta device, fake process group): the most
    parameters on a rank is hybrid_layout's count."""
    from distlab.gpt.arguments import parse_args
    from distlab.gpt.arguments.validation import engine_layout
    from distlab.gpt.planning.dry_run import dry_run

    for (tp, pp), most in hybrid_layout.layouts(LOCAL, 2).items():
        argv = shlex.split(LOCAL.args()) + ["--max-position-embeddings", "64", "--mock-data", "--tokenizer-type",
                                            "NullTokenizer", "--vocab-size", "4096", "--train-iters", "1", "--lr", "1e-4",
                                            "--micro-batch-size", "1",
                                            "--tensor-model-parallel-size", str(tp),
                                            "--pipeline-model-parallel-size", str(pp)]  # fmt: skip
        args = parse_args(argv)
        layout = engine_layout(args, 4)
        assert max(dry_run(args, layout, rank).parameters for rank in range(4)) == most, (tp, pp)


def test_the_learner_sees_the_limits_not_the_layouts():
    source = next(c for c in cells(NOTEBOOK) if c.startswith("print(hybrid_layout.describe("))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(source, {"hybrid_layout": hybrid_layout, "LAB": SimpleNamespace(model=LOCAL), "PROCS": 2})
    shown = out.getvalue()
    assert "2 nodes x 2 ranks" in shown and "466,304 parameters" in shown
    assert "at most 211,000 parameters on any rank; at most 2 sequences per forward" in shown
    assert "1/9 of the step" in shown
    counts = {f"{n:,}" for k, n in hybrid_layout.layouts(LOCAL, 2).items() if k != (1, 1)}
    assert not any(c in shown for c in counts) and not ANSWER.search(shown)
    exercise = next(c for c in cells(NOTEBOOK) if c.startswith("## 3. Exercise"))
    assert not ANSWER.search(exercise)
    script = next(c for c in cells(NOTEBOOK) if c.startswith("%%writefile jobs/gpt-hybrid.sbatch"))
    assert script.count("#FIXME") == 4


def test_the_check_cell_waits_passes_and_fails(tmp_path, monkeypatch):
    result, out = run_check_cell(tmp_path, monkeypatch, None)
    assert result is False and "[not yet]" in out
    start = time.perf_counter()
    result, out = run_check_cell(tmp_path, monkeypatch, run_log(2, 2))
    assert time.perf_counter() - start < 1.0
    assert result is True and f"[ok] {hybrid_layout.NAME}" in out and "[ok] micro-batches per step: 8" in out
    wrong = {
        "TP across the nodes": (run_log(4, 1, m=1), hybrid_layout.CROSS_HINT.format(tp=4, procs=2)),
        "a pipeline of 4": (run_log(1, 4, m=24), None),
        "DP 2": (run_log(2, 1, m=1), None),
        "did not finish": (run_log(2, 2, last_it=2), hybrid_layout.FINISHED_HINT),
        "one node": (run_log(2, 1, world=2, m=1), hybrid_layout.WORLD_HINT.format(nodes=2, procs=2)),
        "micro batch 1": (run_log(2, 2, micro=1), None),
        "m = 4": (run_log(2, 2, m=4), None),
    }
    for why, (log, hint) in wrong.items():
        with pytest.raises(ExerciseError) as told:
            run_check_cell(tmp_path, monkeypatch, log, m=8 if "m = 4" not in why else 4)
        message = str(told.value)
        said, given = message.split(" is not right. ", 1)
        if hint is not None:
            assert given == hint, (why, message)
        assert not ANSWER.search(given), (why, given)
    with pytest.raises(ExerciseError, match="above the limit of 211,000"):
        run_check_cell(tmp_path, monkeypatch, run_log(1, 4, m=24))


def test_a_layout_within_the_limits_with_a_larger_global_batch(capsys):
    """On 2 nodes x 4 GPUs, TP 2 x PP 4 fits the limit, but its bubble needs m = 24: TP 4 x PP 2 gets
    there with 8."""
    log = run_log(2, 4, world=8, m=24, model=GPU)
    said, right, hint = hybrid_layout.judge(log, GPU, 4)
    assert not right and hint == hybrid_layout.GLOBAL_HINT
    said, right, _ = hybrid_layout.judge(run_log(4, 2, world=8, m=8, model=GPU), GPU, 4)
    assert right and said.startswith("TP 4 x PP 2 x DP 1, global batch 16")


def test_the_solution_script_is_an_answer(tmp_path, monkeypatch):
    """The solution's #FIXME lines, with LAB_PROCS_PER_NODE = 2, are the answer, and a run of them passes."""
    script = next(c for c in cells(SOLUTION) if c.startswith("%%writefile jobs/gpt-hybrid.sbatch"))
    values = dict(re.findall(r"^(TP_SIZE|PP_SIZE|MICRO_BATCH_SIZE|GLOBAL_BATCH_SIZE)=(\S+)", script, re.M))
    values = {k: int(v.replace("$LAB_PROCS_PER_NODE", "2")) for k, v in values.items()}
    assert hybrid_layout.answers(LOCAL, 2) == {
        (values["TP_SIZE"], values["PP_SIZE"]): values["GLOBAL_BATCH_SIZE"]
    }
    assert values["MICRO_BATCH_SIZE"] == hybrid_layout.MAX_MICRO
    m = values["GLOBAL_BATCH_SIZE"] // values["MICRO_BATCH_SIZE"]
    assert run_check_cell(tmp_path, monkeypatch, run_log(values["TP_SIZE"], values["PP_SIZE"], m=m), m=m)[0]
    check_cell = next(c for c in cells(SOLUTION) if c.startswith("hybrid_layout.check_run("))
    assert "model=LAB.model, procs=PROCS" in check_cell
