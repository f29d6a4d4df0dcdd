"""Notebook 07's exercise check (section 5): a micro batch of at least TARGET, completed within the
budget, and a prediction within 30% of the measured peak. The committed check cell runs on logs as
the driver prints them: right passes, wrong fails, untouched (no job yet) waits."""

from __future__ import annotations

import json

import pytest

from distlab import REPO_ROOT
from distlab.checks import ExerciseError
from distlab.logs import memory
from distlab.logs.formats import BATCH, PREDICTION
from tests.test_notebook_checks import run_cell

TARGET = 80  # the local cluster: plain fp32 fitted up to 64 in 1300 MiB; a quarter above


def exercise_check_cell() -> str:
    cells = json.loads((REPO_ROOT / "notebooks" / "07_memory_and_batch_size.ipynb").read_text())["cells"]
    return next(
        "".join(c["source"])
        for c in cells
        if "check(" in "".join(c["source"]) and "TARGET" in "".join(c["source"])
    )


def fit_job(micro: int, state: str = "COMPLETED", measured: float = 600.0):
    """A finished gpt-fit job: its batch and memory lines as pretrain_gpt.py prints them."""
    text = "\n".join(
        [
            BATCH.format(global_batch=micro, micro_batch=micro, dp=1, accumulation=1),
            PREDICTION.format(predicted=500.0, measured=measured, how="peak RSS", baseline=690, error=20.0),
        ]
    )
    return type("Job", (), {"state": state, "log": lambda self: text})()


def run(fit, predicted_mib=550.0) -> str:
    context = {"memory": memory, "TARGET": TARGET}
    return run_cell(exercise_check_cell(), {"fit": fit, "predicted_mib": predicted_mib}, context)


def test_the_target_within_the_budget_passes():
    assert run(fit_job(TARGET)).count("[ok]") == 2
    assert run(fit_job(96)).count("[ok]") == 2


@pytest.mark.parametrize(
    "fit,predicted",
    [
        (fit_job(TARGET - 1), 550.0),  # above the plain limit (64), below the target
        (fit_job(64), 550.0),  # the plain limit itself
        (fit_job(128, state="OUT_OF_MEMORY"), 550.0),  # large enough, but killed by the budget
        (fit_job(TARGET), 300.0),  # the run is right, the prediction 50% off
    ],
    ids=["below-target", "plain-limit", "out-of-memory", "prediction-off"],
)
def test_wrong_answers_fail(fit, predicted):
    with pytest.raises(ExerciseError):
        run(fit, predicted)


def test_untouched_waits():
    out = run(None, "FIXME")
    assert "[not yet]" in out and "[ok]" not in out
