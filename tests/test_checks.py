"""The exercise checks: right passes, untouched is a note (not a failure), wrong raises with the hint."""

import pytest

from distlab.checks import FIXME, ExerciseError, check, script_untouched, untouched


def test_untouched_placeholders():
    assert untouched(FIXME) and untouched("TP_SIZE=#FIXME") and untouched(...)
    assert untouched([1, FIXME]) and untouched({"tp": FIXME})
    assert not untouched(0, "", None, [1, 2], {"tp": 2})


def test_right_answer_passes(capsys):
    assert check("world size", 4, expected=4)
    assert check("ranks", [2, 3], expected=(2, 3))
    assert check("bubble", 0.5 + 1e-9, expected=0.5)
    assert check("even", 6, ok=lambda a: a % 2 == 0)
    assert capsys.readouterr().out.count("[ok]") == 4


def test_untouched_answer_does_not_fail(capsys):
    assert check("world size", FIXME, expected=4) is False
    assert "[not yet] world size" in capsys.readouterr().out


def test_wrong_answer_raises_with_hint_and_keeps_the_answer_hidden():
    with pytest.raises(ExerciseError, match="3 is not right.*count every rank") as err:
        check("world size", 3, expected=4, hint="count every rank")
    assert "expected" not in str(err.value)
    with pytest.raises(ExerciseError, match="expected 4"):
        check("world size", 3, expected=4, reveal=True)
    with pytest.raises(ExerciseError):
        check("bubble", 0.6, expected=0.5)
    with pytest.raises(ExerciseError):
        check("even", 7, ok=lambda a: a % 2 == 0)


def test_check_needs_one_criterion():
    with pytest.raises(ValueError):
        check("x", 1)


def test_script_untouched(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text("TP_SIZE=#FIXME\n")
    assert script_untouched(script)
    script.write_text("TP_SIZE=2\n")
    assert not script_untouched(script)
