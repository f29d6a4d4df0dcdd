"""Notebook 08's exercise check (the MLP's DTensor plan), as the notebook calls it: untouched it
says what to do without failing; a wrong plan fails saying what is wrong (PyTorch's refusal, or
collectives between fc1 and fc2 although the losses are right); Megatron's split passes.

Each plan trains 2 steps on 2 spawned gloo ranks (``try_mlp_plan``) against one process.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from distlab.checks import FIXME, ExerciseError, check, untouched
from distlab.gpt.native.plan_check import plan_is_right, try_mlp_plan, what_is_wrong

pytestmark = pytest.mark.timeout(300)


def _check(mlp_plan: dict) -> bool:  # the notebook's cell
    result = None if untouched(mlp_plan) else try_mlp_plan(mlp_plan, steps=2)
    return check(
        "your MLP plan",
        result if result is not None else FIXME,
        ok=plan_is_right,
        hint=what_is_wrong(result) if result is not None else "",
    )


def test_untouched_says_what_to_do_without_failing(capsys):
    assert _check({"fc1": FIXME, "fc2": FIXME}) is False
    assert "[not yet] your MLP plan: replace FIXME" in capsys.readouterr().out


def test_a_plan_pytorch_refuses_fails_with_its_reason():
    with pytest.raises(ExerciseError, match="PyTorch could not run it"):
        _check({"fc1": ColwiseParallel(), "fc2": ColwiseParallel()})


def test_a_plan_with_the_right_losses_but_gathers_between_the_layers_fails():
    plan = {
        "fc1": ColwiseParallel(output_layouts=Replicate()),
        "fc2": ColwiseParallel(output_layouts=Replicate()),
    }
    result = try_mlp_plan(plan, steps=2)
    assert result["error"] is None and result["collectives"] != {"all_reduce": 4}, result
    msg = what_is_wrong(result)
    assert "where Megatron's runs {'all_reduce': 4}" in msg and "between fc1 and fc2" in msg
    with pytest.raises(ExerciseError, match="must not communicate between fc1 and fc2"):
        check("your MLP plan", result, ok=plan_is_right, hint=msg)


def test_megatrons_split_passes(capsys):
    assert _check({"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}) is True
    assert "[ok] your MLP plan" in capsys.readouterr().out
