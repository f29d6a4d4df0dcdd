"""Notebook 04's predictions: written before the runs they are about, checked after them.

The cells must come in that order in the notebook (a prediction cell before its job cell), and the
checks pass, fail and wait as written, with the expected values computed in
``distlab.logs.exercise``, never in the notebook.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from distlab import REPO_ROOT
from distlab.checks import FIXME, ExerciseError, check
from distlab.gpt.build import PARAMETERS
from distlab.logs.exercise import check_batch_predictions, check_parameter_prediction

NOTEBOOK = REPO_ROOT / "notebooks" / "04_gpt_data_parallel.ipynb"


def sources() -> list[str]:
    return ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]]


def index(needle: str) -> int:
    (i,) = [i for i, s in enumerate(sources()) if needle in s]
    return i


def run_cell(source: str, **names) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<cell>", "exec"), {"check": check, "FIXME": FIXME, **names})
    return out.getvalue()


def test_each_prediction_comes_before_its_run_and_its_check_after():
    assert index("predicted_parameters = FIXME") < index('one = jobs.run("jobs/gpt-1proc.sbatch"')
    assert index('one = jobs.run("jobs/gpt-1proc.sbatch"') < index(
        "check_parameter_prediction(predicted_parameters"
    )
    assert index("accumulation_steps = FIXME") < index('exercise = jobs.run("jobs/gpt-exercise.sbatch"')
    assert index('exercise = jobs.run("jobs/gpt-exercise.sbatch"') < index("check_batch_predictions(")


def test_no_expected_value_in_the_notebook():
    check_cell = sources()[index("check_batch_predictions(")]
    assert "expected=EX_GLOBAL" not in check_cell and "//" not in check_cell


# the local cluster's model: l = 2, h = 64, s = 64, V = 4096 (course.SIZES["04"])
FORMULA = 12 * 2 * 64**2 + 13 * 2 * 64 + (4096 + 64) * 64  # section 2's, without the final LayerNorm
PRINTED = FORMULA + 2 * 64


def log_with(parameters: int) -> str:
    return PARAMETERS.format(tp_rank=0, pp_rank=0, parameters=parameters) + "\n"


def test_parameter_prediction_cell():
    source = sources()[index("check_parameter_prediction(predicted_parameters")]
    one = type("Job", (), {"log": lambda self: log_with(PRINTED)})()
    for right in (FORMULA, PRINTED, round(PRINTED * 1.009)):
        assert "[ok]" in run_cell(
            source, one=one, predicted_parameters=right, check_parameter_prediction=check_parameter_prediction
        )
    for wrong in (
        12 * 2 * 64**2,
        (4096 + 64) * 64,
        round(PRINTED * 1.02),
        str(PRINTED),
    ):  # blocks only; embeddings only
        with pytest.raises(ExerciseError, match="section 2's formula"):
            run_cell(
                source,
                one=one,
                predicted_parameters=wrong,
                check_parameter_prediction=check_parameter_prediction,
            )
    untouched = run_cell(
        source, one=one, predicted_parameters=FIXME, check_parameter_prediction=check_parameter_prediction
    )
    assert "[not yet]" in untouched and "[ok]" not in untouched


@pytest.mark.parametrize("dp,iters", [(4, 10), (8, 50)])  # the local cluster (2 x 2), a GPU site (2 x 4)
def test_batch_predictions(dp, iters, capsys):
    task = dict(micro=1, global_batch=16, dp=dp, iters=iters)
    assert check_batch_predictions(16 // dp, 16, 16 * iters, **task) is True
    assert capsys.readouterr().out.count("[ok]") == 3
    for wrong in ((16, 16, 16 * iters), (16 // dp, dp, 16 * iters), (16 // dp, 16, 16 * iters // (16 // dp))):
        with pytest.raises(ExerciseError):
            check_batch_predictions(*wrong, **task)
    capsys.readouterr()
    assert check_batch_predictions(FIXME, FIXME, FIXME, **task) is False
    out = capsys.readouterr().out
    assert out.count("[not yet]") == 3 and "[ok]" not in out
