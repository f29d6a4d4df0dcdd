"""Notebook 07's fp16 check (section 3): the logged loss scales follow the rule written out in the
cell, Megatron-LM's DynamicGradScaler (an overflow uses up one unit of hysteresis and halves the
scale once none is left; the window-th clean step in a row doubles it and restores the hysteresis).

The rule is taken from the committed cell itself, so these tests hold the notebook to Megatron's
sequences worked out by hand, show that the engine's scaler passes it, and that a log whose scales
follow another rule (halving at the first overflow, DeepSpeed's doubling one step later) fails it.
"""

from __future__ import annotations

import ast
import json
import random

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from distlab import REPO_ROOT
from distlab.gpt.optimizer.loss_scaler import DynamicLossScaler


def check_cell() -> str:
    cells = json.loads((REPO_ROOT / "notebooks" / "07_memory_and_batch_size.ipynb").read_text())["cells"]
    found = [c for c in cells if "def scales_by_the_rule" in "".join(c["source"])]
    assert len(found) == 1
    return "".join(found[0]["source"])


def the_rule():
    """The cell's ``scales_by_the_rule``, compiled alone (the cell also greps and plots)."""
    tree = ast.parse(TransformerManager().transform_cell(check_cell()))
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "scales_by_the_rule")
    namespace: dict = {}
    exec(compile(ast.Module(body=[func], type_ignores=[]), "<cell>", "exec"), namespace)
    return namespace["scales_by_the_rule"]


def the_assertion(scales: list[float], skipped: list[int]) -> None:
    """The cell's assertion on a run's logged ``scales`` and ``skipped`` (the job's flags)."""
    tree = ast.parse(TransformerManager().transform_cell(check_cell()))
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    keep += [n for n in tree.body if "rule" in ast.unparse(n) and not isinstance(n, ast.FunctionDef)]
    namespace: dict = {"r": {"scales": scales, "skipped": skipped}}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "<cell>", "exec"), namespace)


@pytest.mark.parametrize(
    "overflows,scale,window,hysteresis,after",
    [
        # the notebook's four iterations: hysteresis, halving, doubling (hysteresis restored), hysteresis again
        ([1, 1, 0, 1], 2**19, 1, 2, [2**19, 2**18, 2**19, 2**19]),
        # window 2: the second clean step doubles, an overflow restarts the count
        ([0, 0, 0, 1, 0, 0], 8, 2, 2, [8, 16, 16, 16, 16, 32]),
        # once the hysteresis is used up, every further overflow halves (clean steps below the window do not restore it)
        ([1, 1, 0, 1, 1], 64, 3, 2, [64, 32, 32, 16, 8]),
        # hysteresis 1: the first overflow halves
        ([1, 0, 1], 64, 5, 1, [32, 32, 16]),
    ],
)
def test_the_rule_gives_megatrons_sequences(overflows, scale, window, hysteresis, after) -> None:
    assert the_rule()([bool(o) for o in overflows], scale, window, hysteresis) == after


def test_the_engines_scaler_follows_the_rule() -> None:
    rule, rng = the_rule(), random.Random(7)
    for _ in range(200):
        window, hysteresis = rng.randint(1, 4), rng.randint(1, 3)
        overflows = [rng.random() < 0.4 for _ in range(rng.randint(1, 20))]
        scaler, scales = DynamicLossScaler(initial_scale=2.0**16, window=window, hysteresis=hysteresis), []
        for overflow in overflows:
            scaler.update(found_inf=overflow)
            scales.append(scaler.scale)
        assert scales == rule(overflows, 2.0**16, window, hysteresis), (overflows, window, hysteresis)


def test_the_check_passes_the_right_log_and_fails_a_wrong_one() -> None:
    the_assertion([2**19, 2**18, 2**19, 2**19], [1, 1, 0, 1])
    with pytest.raises(AssertionError, match="the rule's"):  # halved at the first overflow: no hysteresis
        the_assertion([2**18, 2**17, 2**18, 2**17], [1, 1, 0, 1])
    with pytest.raises(AssertionError, match="the rule's"):  # DeepSpeed's count: doubles one clean step later
        the_assertion([2**19, 2**18, 2**18, 2**17], [1, 1, 0, 1])
