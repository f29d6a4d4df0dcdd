"""Notebook 11's exercise behind its check (``distlab.exercises.llama_layout``): the learner sees the
constraint (the model, the cluster, the budget in MiB), never the estimate of each layout.

The notebook's own cells run here: the budget cell gives the budget of the formula it replaced and
defines no table of predictions (nor does any cell print one); the check cell says "not yet" before
the run, passes the solution's run (tp 2 with the distributed optimizer) and fails typical wrong runs
with a hint that names neither the flag nor the layout; it takes well under a second or two.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from types import SimpleNamespace

import pytest

from distlab import REPO_ROOT
from distlab.checks import ExerciseError
from distlab.exercises import llama_layout
from distlab.logs.exercise import state_layout_predictions
from tests.test_llama_layout_exercise import budget_of, run_log

NOTEBOOK = REPO_ROOT / "notebooks" / "11_llama3_and_mixtral.ipynb"
SOLUTION = REPO_ROOT / "solutions" / "11_llama3_and_mixtral_solution.ipynb"


def cells(path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]


def ex_args(path=NOTEBOOK) -> str:
    """The notebook's EX_ARGS, from its setup cell."""
    setup = next(c for c in cells(path) if 'os.environ["EX_ARGS"] = (' in c)
    found = re.search(r'os\.environ\["EX_ARGS"\] = \((.*?)\n\)', setup, re.S)
    return eval("(" + found.group(1) + ")")  # adjacent string literals and their comments


@pytest.fixture(scope="module")
def namespace() -> dict:
    """The notebook's budget cell, run as on the local cluster (2 nodes x 2 processes)."""
    source = next(c for c in cells(NOTEBOOK) if c.startswith("BUDGET_MIB = "))
    notebook_os = SimpleNamespace(environ={"EX_ARGS": ex_args()})  # the cells read os.environ only
    namespace = {"os": notebook_os, "llama_layout": llama_layout, "WORLD": 4, "PROCS": 2}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(source, namespace)
    namespace["printed"] = out.getvalue()
    return namespace


def run_check_cell(namespace: dict, log: str | None) -> bool:
    source = next(c for c in cells(NOTEBOOK) if c.startswith("llama_layout.check_run("))
    job = None if log is None else type("Job", (), {"log": lambda self: log})()
    here = {**namespace, "budget_job": job}
    exec(f"result = {source}", here)
    return here["result"]


def test_the_learner_sees_the_constraint_not_the_table(namespace):
    predicted = state_layout_predictions(ex_args(), world_size=4, vocab_size=32000)
    assert namespace["BUDGET_MIB"] == budget_of(predicted)  # the formula the cell used to show
    assert f"at most {namespace['BUDGET_MIB']} MiB per rank" in namespace["printed"]
    assert not any(k in namespace for k in ("PREDICTED", "predicted", "best_with", "best_without"))
    assert "state_layout_predictions" not in "".join(cells(NOTEBOOK))
    fits = sorted(
        {(tp, d) for (tp, _, d), mib in predicted.items() if mib <= namespace["BUDGET_MIB"] and tp <= 2}
    )
    assert fits == [(2, True)]  # one answer inside a node: tp 2 with the distributed optimizer


def test_the_check_cell_waits_passes_and_fails(namespace, capsys):
    n, predicted = namespace["EX_PARAMS"], state_layout_predictions(ex_args(), world_size=4, vocab_size=32000)
    half = n // 2 + 4 * 2 * 128 + 128  # tp 2: half the split weights, the norms on both ranks
    assert run_check_cell(namespace, None) is False
    assert "[not yet]" in capsys.readouterr().out
    start = time.perf_counter()
    assert run_check_cell(namespace, run_log(2, predicted[2, 1, True], half)) is True
    assert time.perf_counter() - start < 2.0
    wrong = {
        "tp 2 without the distributed optimizer": run_log(2, predicted[2, 1, False], half),
        "tp 1 with it": run_log(1, predicted[1, 1, True], n),
        "tp 4 across the nodes": run_log(4, predicted[4, 1, False], n // 4 + 2000),
        "a smaller model": run_log(2, 30.0, n // 4),
        "did not finish": run_log(2, predicted[2, 1, True], half, last_it=1),
    }
    for why, log in wrong.items():
        with pytest.raises(ExerciseError) as told:
            run_check_cell(namespace, log)
        hint = str(told.value).split("is not right.", 1)[1]
        assert "--use-distributed-optimizer" not in hint and "tp 2" not in hint and "TP_SIZE=2" not in hint, (
            why,
            hint,
        )


def test_the_solution_shows_the_table_and_checks_the_same_way():
    sources = cells(SOLUTION)
    budget_cell = next(c for c in sources if c.startswith("BUDGET_MIB = llama_layout.budget_mib("))
    assert ex_args(SOLUTION) == ex_args()
    namespace = {
        "os": SimpleNamespace(environ={"EX_ARGS": ex_args()}),
        "llama_layout": llama_layout,
        "state_layout_predictions": state_layout_predictions,
        "WORLD": 4,
        "PROCS": 2,
    }
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(budget_cell, namespace)
    fits = [line for line in out.getvalue().splitlines() if line.endswith("fits")]
    assert fits and all(f.startswith("tp 2 ") and "distributed optimizer" in f for f in fits), out.getvalue()
    assert any(c.startswith("llama_layout.check_run(") for c in sources)
