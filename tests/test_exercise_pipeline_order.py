"""Notebook 05's 1F1B exercise (``distlab.exercises.pipeline_order``) and its bubble prediction.

The notebook's own cells run here: its stub says "not yet"; GPipe's order (valid, the same bubble, m
alive), an order that deadlocks (the warm-up reversed), one that waits for every backward (valid, a
larger bubble), one a pass short, one with a forward too many in flight and one with a backward
before its forward are told wrong with a hint that does not give the warm-up; the solution notebook's
order passes in milliseconds and is the engine's (``run_1f1b``'s order, as
``tests/test_gpt_pipeline_diagram.py`` reads it), whose replay is the docstring's diagram. The
prediction cell waits, passes within 0.01 and fails; the cell comparing the learner's order with the
engine's measured one says which stages agree.
"""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest

from distlab import REPO_ROOT
from distlab.checks import FIXME, ExerciseError
from distlab.exercises import pipeline_order
from distlab.gpt.pipeline_parallel.timeline import theoretical_bubble
from distlab.logs import pipeline
from tests.test_gpt_pipeline_diagram import docstring_lines, replay, stage_order

NOTEBOOK = REPO_ROOT / "notebooks" / "05_tensor_pipeline_parallel.ipynb"
SOLUTION = REPO_ROOT / "solutions" / "05_tensor_pipeline_parallel_solution.ipynb"
#: What a hint must not say: the warm-up of stage s.
ANSWER_WORDS = ("p - s - 1", "p-s-1", "min(p - s", "warmup =", "warm-up forwards")


def cells(path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]


def defined(path):
    namespace = {"FIXME": FIXME}
    exec(next(c for c in cells(path) if c.startswith("def one_f_one_b(")), namespace)
    return namespace["one_f_one_b"]


def run_check_cell(fn) -> tuple[bool, str]:
    source = next(c for c in cells(NOTEBOOK) if c.startswith("pipeline_order.check_order("))
    namespace = {"pipeline_order": pipeline_order, "one_f_one_b": fn}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(f"result = {source}", namespace)
    return namespace["result"], out.getvalue()


def engine(p: int, m: int):
    """The engine's order, stage by stage (``run_1f1b``'s, as the diagram test reads it)."""
    return [stage_order("1f1b", p, m, s) for s in range(p)]


def gpipe(p, m):
    return [stage_order("gpipe", p, m, s) for s in range(p)]


def with_warmup(warmup):
    def order(p, m):
        out = []
        for s in range(p):
            w = min(warmup(p, s), m)
            stage = [("F", i) for i in range(w)]
            for j in range(m - w):
                stage += [("F", w + j), ("B", j)]
            out.append(stage + [("B", i) for i in range(m - w, m)])
        return out

    return order


def one_pass_short(p, m):
    return [stage[:-1] for stage in engine(p, m)]


def backward_first(p, m):
    return [[("B", 0)] + [x for x in stage if x != ("B", 0)] for stage in engine(p, m)]


WRONG = {
    "GPipe": (gpipe, pipeline_order.MEMORY_HINT),
    "the warm-up reversed (deadlock)": (with_warmup(lambda p, s: s), pipeline_order.DEADLOCK_HINT),
    "no warm-up": (with_warmup(lambda p, s: 0), pipeline_order.BUBBLE_HINT),
    "one warm-up forward too many": (with_warmup(lambda p, s: p - s), pipeline_order.MEMORY_HINT),
    "a pass short": (one_pass_short, pipeline_order.MISSING_HINT),
    "a backward before its forward": (backward_first, pipeline_order.OWN_FORWARD_HINT),
    "not a list per stage": (
        lambda p, m: [x for stage in engine(p, m) for x in stage],
        pipeline_order.FORMAT_HINT,
    ),
}


def test_the_untouched_stub_is_not_yet():
    result, out = run_check_cell(defined(NOTEBOOK))
    assert result is False and "[not yet]" in out


@pytest.mark.parametrize("why", list(WRONG))
def test_a_wrong_order_gets_its_hint_and_not_the_answer(why):
    fn, hint = WRONG[why]
    with pytest.raises(ExerciseError) as told:
        run_check_cell(fn)
    message = str(told.value)
    assert message.endswith(hint), message
    assert not any(word in hint for word in ANSWER_WORDS), hint


def test_a_deadlock_names_what_each_stage_waits_for():
    said, right, _ = pipeline_order.judge(with_warmup(lambda p, s: s))
    assert not right
    assert said == (
        "p = 2, m = 4: deadlock: stage 0 waits to run B0, which needs B0 of stage 1; "
        "stage 1 waits to run F1, which needs F1 of stage 0"
    )


def test_the_solution_passes_and_is_the_engines_order():
    solution = defined(SOLUTION)
    start = time.perf_counter()
    result, out = run_check_cell(solution)
    assert time.perf_counter() - start < 0.5
    assert result is True and out.startswith(f"[ok] {pipeline_order.NAME}: "), out
    assert "idle 27.3% of the step ((p - 1)/(m + p - 1) = 27.3%) and hold at most [4, 3, 2, 1]" in out
    for p in range(1, 6):
        for m in range(1, 10):
            assert solution(p, m) == engine(p, m)
    assert run_check_cell(lambda p, m: pipeline_order.labels(engine(p, m)))[0] is True  # "F0" strings too


def test_the_replay_is_the_schedules_docstring():
    """The checker's replay of the engine's orders is the diagram test's, and so the docstring's."""
    for name, schedule in (("GPipe", gpipe), ("1F1B", engine)):
        chart = pipeline_order.chart(schedule(2, 4))
        rows = [line.split(":", 1)[1].split() for line in chart.splitlines()]
        assert rows == docstring_lines(name) == replay("gpipe" if name == "GPipe" else "1f1b", 2, 4)
    for p, m in pipeline_order.CASES:
        done, stuck = pipeline_order.replay(engine(p, m))
        assert not stuck and pipeline_order.bubble(done, p, m) == pytest.approx(theoretical_bubble(p, m))


def test_the_bubble_prediction_waits_passes_and_fails(capsys):
    cell = next(c for c in cells(NOTEBOOK) if c.startswith("predicted_bubble = "))
    check_cell = next(c for c in cells(NOTEBOOK) if c.startswith("pp4 = {m: load_timeline("))
    timelines = {1: {"measured_bubble": 0.78}, 8: {"measured_bubble": 0.41}}
    namespace = {
        "FIXME": FIXME,
        "pipeline_order": pipeline_order,
        "load_timeline": lambda path: timelines[int(path[-6])],
    }
    exec(cell, namespace)
    exec(check_cell, namespace)
    out = capsys.readouterr().out
    assert "[not yet]" in out and "m = 8: measured 0.41 of the last step, ideal 0.27" in out
    for wrong in ({1: 0.5, 8: 3 / 11}, {1: 0.75, 8: 3 / 8}, {1: 0.75}, 0.27):
        namespace["predicted_bubble"] = wrong
        with pytest.raises(ExerciseError) as told:
            exec(check_cell, namespace)
        hint = str(told.value).split(" is not right. ", 1)[1]
        assert "0.27" not in hint and "3/11" not in hint and "0.75" not in hint
    namespace["predicted_bubble"] = {1: 0.75, 8: 0.28}  # within 0.01
    exec(check_cell, namespace)
    assert "[ok]" in capsys.readouterr().out
    solution = next(c for c in cells(SOLUTION) if c.startswith("predicted_bubble = "))
    exec(solution, {"pipeline_order": pipeline_order})
    assert "[ok]" in capsys.readouterr().out


def test_the_comparison_with_the_engines_measured_order(capsys):
    """The cell after the timelines: each stage of the learner's order against the measured one;
    nothing printed while the exercise is a stub."""
    cell = next(c for c in cells(NOTEBOOK) if c.startswith("mine = pipeline_order.labels("))
    measured = {"events": [], "chunks": 1}
    for s, stage in enumerate(engine(4, 8)):
        for t, (kind, i) in enumerate(stage):
            measured["events"].append(
                {"stage": s, "kind": kind, "mb": i, "chunk": 0, "start": t, "end": t + 0.5}
            )
    namespace = {"pipeline_order": pipeline_order, "pipeline": pipeline, "pp4": {8: measured}}
    for fn, said in ((defined(NOTEBOOK), None), (defined(SOLUTION), "is"), (gpipe, "is not")):
        exec(cell, {**namespace, "one_f_one_b": fn})
        out = capsys.readouterr().out
        if said is None:
            assert out == ""
        else:
            assert out.count(f"your 1F1B order {said} the engine's") == 4, out
