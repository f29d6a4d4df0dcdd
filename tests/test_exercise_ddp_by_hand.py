"""Notebook 03's write-it-yourself exercise (``distlab.exercises.ddp_by_hand``): data parallelism by
hand, gradients averaged by asynchronous bucketed all-reduces started from gradient hooks.

The learner's file is the notebook's own ``%%writefile`` cell (the stub, still FIXME) or the solution
notebook's (the right answer); each typical wrong answer is the right one with one mistake (a sum, the
all-reduces started after backward, a wait inside the hook, no wait, a blocking all-reduce, one
all-reduce per gradient). Each runs on 2 spawned gloo ranks through the checker the notebook calls,
against torch's DDP: a wrong answer is told wrong with a hint that holds none of the solution's
code; the right one passes with its parameters DDP's to the last bit (tolerance 0.1% of DDP's
change, a sum is 100% off). The prediction cell runs as written. The helpers here serve
``test_exercise_zero_one`` too.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from distlab import REPO_ROOT
from distlab.checks import FIXME, ExerciseError, check
from distlab.exercises import ddp_by_hand

pytestmark = pytest.mark.timeout(600)


def cells(folder: str, notebook: str) -> list[str]:
    path = REPO_ROOT / folder / f"{notebook}.ipynb"
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]


def written_file(folder: str, notebook: str, name: str) -> str:
    """The body of the notebook's ``%%writefile jobs/<name>`` cell."""
    head = f"%%writefile jobs/{name}\n"
    (cell,) = [c for c in cells(folder, notebook) if c.startswith(head)]
    return cell.removeprefix(head) + "\n"


def cell_with(notebook: str, *needles: str) -> str:
    """The notebook's one code cell holding every needle."""
    (cell,) = [c for c in cells("notebooks", notebook) if all(n in c for n in needles)]
    return cell


def run_cell(source: str, **names) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<cell>", "exec"), {"check": check, "FIXME": FIXME, **names})
    return out.getvalue()


def variant(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def assert_hint_hides(message: str, answer_code: list[str]) -> None:
    for code in answer_code:
        assert code not in message, f"the hint gives the answer away ({code!r}): {message}"


@pytest.fixture
def job_file(tmp_path: Path):
    def write(name: str, text: str) -> Path:
        path = tmp_path / "jobs" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return path

    return write


DDP_STUB = written_file("notebooks", "03_cifar_ddp", "ddp_by_hand.py")
DDP_RIGHT = written_file("solutions", "03_cifar_ddp_solution", "ddp_by_hand.py")
DDP_ANSWER = ["register_post_accumulate_grad_hook", "async_op=True", "/= self.world", ".wait()", "torch.cat"]
LAUNCH = """            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])  # (n_bucket,)
            handle = dist.all_reduce(flat, async_op=True)  # returns at once; the sum arrives later
            self.in_flight.append((handle, flat, self.buckets[i]))
"""
WAIT = "            handle.wait()\n"
AVERAGE = "            flat /= self.world  # the sum over the ranks -> their average\n"
DDP_WRONG = {  # name: (the learner's file, what the message says)
    "sums instead of averaging": (variant(DDP_RIGHT, AVERAGE, ""), "first update is 2.00 times DDP's"),
    "starts every all-reduce after backward": (
        variant(
            variant(DDP_RIGHT, LAUNCH, "            pass\n"),
            "        for handle, flat, bucket in self.in_flight:\n",
            "        for bucket in self.buckets:\n"
            "            flat = torch.cat([p.grad.reshape(-1) for p in bucket])\n"
            "            self.in_flight.append((dist.all_reduce(flat, async_op=True), flat, bucket))\n"
            "        for handle, flat, bucket in self.in_flight:\n",
        ),
        "6 of 6 all-reduces started after loss.backward() had returned",
    ),
    "waits in the hook": (
        variant(
            DDP_RIGHT,
            "            self.in_flight.append",
            "            handle.wait()\n            self.in_flight.append",
        ),
        "backward stopped to wait for an all-reduce",
    ),
    "never waits": (variant(DDP_RIGHT, WAIT, ""), "was never waited for before the optimizer step"),
    "blocking all-reduce": (
        variant(
            variant(
                DDP_RIGHT, "handle = dist.all_reduce(flat, async_op=True)", "handle = dist.all_reduce(flat)"
            ),
            WAIT,
            "",
        ),
        "an all-reduce ran synchronously",
    ),
    "an all-reduce per gradient": (
        variant(
            DDP_RIGHT,
            LAUNCH,
            "            for p in self.buckets[i]:\n"
            "                flat = p.grad.reshape(-1).clone()\n"
            "                self.in_flight.append((dist.all_reduce(flat, async_op=True), flat, [p]))\n",
        ),
        "a step started 62 all-reduces for 6 buckets",
    ),
}


def test_ddp_stub_and_missing_file_are_not_yet(job_file, capsys):
    assert "FIXME" in DDP_STUB and "FIXME" not in DDP_RIGHT
    assert ddp_by_hand.check_ddp_by_hand(job_file("ddp_by_hand.py", DDP_STUB)) is False
    assert ddp_by_hand.check_ddp_by_hand(job_file("ddp_by_hand.py", DDP_STUB).with_name("absent.py")) is False
    out = capsys.readouterr().out
    assert out.count("[not yet] data parallelism by hand") == 2 and "[ok]" not in out


def test_ddp_right_answer_passes_with_margin(job_file, capsys):
    ranks = ddp_by_hand.run(job_file("ddp_by_hand.py", DDP_RIGHT))
    worst = max(e for r in ranks for e in r["rel_errors"])
    assert worst <= ddp_by_hand.RTOL / 100, worst  # measured: 0 (the same sums as DDP's)
    assert [s["calls"] for r in ranks for s in r["steps"]] == [6] * 6
    assert ddp_by_hand.judge(ranks) is True
    out = capsys.readouterr().out
    assert "[ok] data parallelism by hand: 3 steps on 2 ranks equal DDP's" in out
    assert "6 all-reduces per step, all started during backward" in out and "passed while backward ran" in out


@pytest.mark.parametrize("name", list(DDP_WRONG))
def test_ddp_typical_wrong_answer_is_told_wrong(name, job_file):
    text, says = DDP_WRONG[name]
    ranks = ddp_by_hand.run(job_file("ddp_by_hand.py", text))
    with pytest.raises(ExerciseError) as err:
        ddp_by_hand.judge(ranks)
    assert says in str(err.value), str(err.value)
    assert_hint_hides(str(err.value), DDP_ANSWER)
    if name == "sums instead of averaging":  # far outside the tolerance
        assert min(r["rel_errors"][0] for r in ranks) >= 100 * ddp_by_hand.RTOL


def test_ddp_code_that_raises_is_told_where(job_file):
    text = variant(DDP_RIGHT, "flat /= self.world", "flat /= self.worlds")
    with pytest.raises(
        ExerciseError, match=r"your code raised on rank \d: AttributeError: .*'worlds'.*line \d+"
    ):
        ddp_by_hand.check_ddp_by_hand(job_file("ddp_by_hand.py", text))


def test_first_ready_prediction_cell():
    source = cell_with("03_cifar_ddp", "first_ready_layer, ok=ddp_by_hand.is_first_ready")
    assert "[ok]" in run_cell(source, ddp_by_hand=ddp_by_hand, first_ready_layer="fc")
    assert "[ok]" in run_cell(source, ddp_by_hand=ddp_by_hand, first_ready_layer="fc.bias")
    for wrong in ("conv1", "layer4.1.bn2", "layer1.0.conv1"):
        with pytest.raises(ExerciseError):
            run_cell(source, ddp_by_hand=ddp_by_hand, first_ready_layer=wrong)
    untouched = run_cell(source, ddp_by_hand=ddp_by_hand, first_ready_layer=FIXME)
    assert "[not yet]" in untouched and "[ok]" not in untouched
