"""Notebook 07's exercise check (section 5): a micro batch of at least TARGET, completed within the
budget the notebook set (the job's --mem, or on a GPU site the --device-memory-gib cap, read from the
job's log), and a prediction within 30% of the measured peak. The committed check cell runs on logs as
the driver prints them: right passes, wrong fails, untouched (no job yet) waits."""

from __future__ import annotations

import json

import pytest

from distlab import REPO_ROOT
from distlab.checks import ExerciseError
from distlab.gpt.build import BATCH
from distlab.gpt.memory.meters import PREDICTION
from distlab.logs import memory
from tests.test_notebook_checks import run_cell

TARGET = 80  # the local cluster: plain fp32 fitted up to 64 in 1300 MiB; a quarter above


def exercise_check_cell() -> str:
    cells = json.loads((REPO_ROOT / "notebooks" / "07_memory_and_batch_size.ipynb").read_text())["cells"]
    return next(
        "".join(c["source"])
        for c in cells
        if "check(" in "".join(c["source"]) and "TARGET" in "".join(c["source"])
    )


BUDGET_MIB = 1300  # the local cluster's #SBATCH --mem; a GPU site's --device-memory-gib 16 is 16384


def fit_job(micro: int, state: str = "COMPLETED", measured: float = 600.0, limit: int = BUDGET_MIB,
            cap: str | None = None):  # fmt: skip
    """A finished gpt-fit job: its batch and memory lines as pretrain_gpt.py prints them, then
    job_peak_memory.py's line with the job's memory limit (and on a GPU site the cap's line)."""
    lines = [] if cap is None else [cap]
    lines += [
        BATCH.format(global_batch=micro, micro_batch=micro, dp=1, accumulation=1),
        PREDICTION.format(predicted=500.0, measured=measured, how="peak RSS", baseline=690, error=20.0),
        f"job 231: peak 1100 MiB of its {limit} MiB limit (memory cgroup v1)",
    ]
    text = "\n".join(lines)
    return type("Job", (), {"state": state, "log": lambda self: text})()


def run(fit, predicted_mib=550.0, backend: str = "gloo", budget: int = BUDGET_MIB) -> str:
    context = {"memory": memory, "TARGET": TARGET, "BACKEND": backend, "BUDGET_MIB": budget}
    return run_cell(exercise_check_cell(), {"fit": fit, "predicted_mib": predicted_mib}, context)


CAPPED = "> CUDA memory capped at 16 GiB of 79.2 GiB per rank (--device-memory-gib)"


def test_the_target_within_the_budget_passes():
    assert run(fit_job(TARGET)).count("[ok]") == 3
    assert run(fit_job(96)).count("[ok]") == 3
    # a GPU site: the cap's line names the budget (the job's --mem is the host's, any size)
    assert run(fit_job(TARGET, limit=65536, cap=CAPPED), backend="nccl", budget=16384).count("[ok]") == 3
    smaller = "> --device-memory-gib 16: the card has only 15.8 GiB, no cap set"  # the card is the budget
    assert run(fit_job(TARGET, limit=65536, cap=smaller), backend="nccl", budget=16384).count("[ok]") == 3


def test_a_run_without_the_notebooks_budget_fails():
    # a GPU site where the learner deleted $GPT_BUDGET from the srun line: no cap, any micro batch fits
    with pytest.raises(ExerciseError, match="budget your job ran under"):
        run(fit_job(TARGET, limit=65536), backend="nccl", budget=16384)
    with pytest.raises(ExerciseError, match="budget your job ran under"):  # another cap than the notebook's
        run(
            fit_job(TARGET, limit=65536, cap=CAPPED.replace("16 GiB", "40 GiB")), backend="nccl", budget=16384
        )
    # the local cluster: a job submitted without the notebook's --mem gets the default 8 GiB
    with pytest.raises(ExerciseError, match="budget your job ran under"):
        run(fit_job(TARGET, limit=8192))


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
