"""Notebooks 03's and 07's write-it-yourself exercises, checked for real: they wait, fail and pass.

The learner's file is the notebook's own ``%%writefile`` cell (the stub, still FIXME) or the solution
notebook's (the right answer); each typical wrong answer is the right one with one mistake. Every
file that is not untouched runs on 2 spawned gloo ranks through the checker the notebook calls
(``ddp_by_hand``: against torch's DDP; ``zero_one``: against torch's AdamW on one process). A wrong
answer must be told wrong with a hint that does not contain the answer's code, and the right one
must pass with a margin: its largest difference is far below the tolerance, the wrong answers'
far above. The prediction cells of both notebooks are run as written, with right, wrong and
untouched answers.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from distlab import REPO_ROOT
from distlab.checks import FIXME, ExerciseError, check
from distlab.exercises import ddp_by_hand, zero_one

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


# ---------------------------------------------------------------------------------------------
# Notebook 03: data parallelism by hand

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


@pytest.fixture
def job_file(tmp_path: Path):
    def write(name: str, text: str) -> Path:
        path = tmp_path / "jobs" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return path

    return write


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


# ---------------------------------------------------------------------------------------------
# Notebook 07: one ZeRO-1 AdamW step

ZERO_STUB = written_file("notebooks", "07_memory_and_batch_size", "zero1_adamw.py")
ZERO_RIGHT = written_file("solutions", "07_memory_and_batch_size_solution", "zero1_adamw.py")
ZERO_ANSWER = ["reduce_scatter_single(", "all_gather_single(", "grad / self.world", "AdamW([self.main]"]
SHARD_OPTIMIZER = "torch.optim.AdamW([self.main], lr=lr"
GATHER = """        flat = torch.empty(self.world * self.shard)
        dist.all_gather_single(flat, self.main.detach())  # [w_0 | w_1 | ... | w_(N-1)]
"""
STEP = ZERO_RIGHT[ZERO_RIGHT.index("        grad = torch.empty(self.shard)\n") :]
WHOLE = variant(ZERO_RIGHT, SHARD_OPTIMIZER, "torch.optim.AdamW(self.params, lr=lr")
ZERO_WRONG = {  # name: (the learner's file, what the message says)
    "forgets to all-gather": (
        variant(
            ZERO_RIGHT,
            GATHER,
            "        flat = self.flat_params()\n        flat[self.lo : self.hi] = self.main.detach()\n",
        ),
        "your 2 ranks hold different parameters after step 1",
    ),
    "the whole vector on every rank, unaveraged": (
        variant(WHOLE, STEP, "        self.optimizer.step()\n"),
        "Collectives your step() called: none",
    ),
    "sums instead of averaging": (
        variant(ZERO_RIGHT, "self.main.grad = grad / self.world", "self.main.grad = grad"),
        "gradient shard is 2.00 times the ranks' average",
    ),
    "the whole vector on every rank, averaged (plain data parallelism)": (
        variant(
            WHOLE,
            STEP,
            "        for p in self.params:\n"
            "            dist.all_reduce(p.grad)\n"
            "            p.grad /= self.world\n"
            "        self.optimizer.step()\n",
        ),
        "each rank keeps 54,880 bytes of optimizer state",
    ),
}


def test_zero_stub_is_not_yet(job_file, capsys):
    assert "FIXME" in ZERO_STUB and "FIXME" not in ZERO_RIGHT
    assert zero_one.check_zero1(job_file("zero1_adamw.py", ZERO_STUB)) is False
    out = capsys.readouterr().out
    assert "[not yet] one ZeRO-1 AdamW step" in out and "[ok]" not in out


def test_zero_right_answer_passes_with_margin(job_file, capsys):
    ranks = zero_one.run(job_file("zero1_adamw.py", ZERO_RIGHT))
    worst = max(e for r in ranks for e in r["rel_errors"])
    assert worst <= zero_one.RTOL / 10, worst  # measured: 3.7e-6 (the same sums in another order)
    full = zero_one.adamw_state_bytes()
    assert full == 8 * zero_one.num_parameters() + 4 * 6  # two fp32 moments, a step per tensor
    assert [r["kept"] for r in ranks] == [8 * 3429 + 4] * 2  # one shard of S = ceil(6,857 / 2)
    assert zero_one.judge(ranks) is True
    assert "0.500 of it (1/N = 0.500)" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(ZERO_WRONG))
def test_zero_typical_wrong_answer_is_told_wrong(name, job_file):
    text, says = ZERO_WRONG[name]
    ranks = zero_one.run(job_file("zero1_adamw.py", text))
    with pytest.raises(ExerciseError) as err:
        zero_one.judge(ranks)
    assert says in str(err.value), str(err.value)
    assert_hint_hides(str(err.value), ZERO_ANSWER)
    if name in ("forgets to all-gather", "the whole vector on every rank, unaveraged"):
        assert max(e for r in ranks for e in r["rel_errors"]) >= 100 * zero_one.RTOL


def test_zero_code_that_raises_is_told_where(job_file):
    text = variant(ZERO_RIGHT, f"self.optimizer = {SHARD_OPTIMIZER}", "self.optimizer = None  # (lr")
    with pytest.raises(
        ExerciseError, match=r"raised on rank \d: AttributeError: 'NoneType' .*'step'.*zero1_adamw.py"
    ):
        zero_one.check_zero1(job_file("zero1_adamw.py", text))


def test_state_bytes_prediction_cell():
    source = cell_with("07_memory_and_batch_size", "predicted_state_bytes, ok=zero_one.is_state_bytes_right")
    p = zero_one.num_parameters()
    for right in (8 * p / 2, 8 * 3429 + 4, 4 * p):
        assert "[ok]" in run_cell(source, zero_one=zero_one, predicted_state_bytes=right)
    for wrong in (8 * p, 16 * p / 2, 4 * p / 2, 12 * p / 2, "27436"):  # unsharded; with weights; one moment
        with pytest.raises(ExerciseError):
            run_cell(source, zero_one=zero_one, predicted_state_bytes=wrong)
    untouched = run_cell(source, zero_one=zero_one, predicted_state_bytes=FIXME)
    assert "[not yet]" in untouched and "[ok]" not in untouched


def test_deepspeed_prediction_cells():
    """Rank 0's ZeRO-1 optimizer state and ZeRO-3 parameters as DeepSpeed reports them on 2 ranks
    (8 P / 2 and 4 P / 2 bytes plus at most 64: tests/test_gpt_deepspeed.py), in MiB."""
    from distlab.course import ModelShape
    from distlab.gpt.memory.parameters import num_parameters

    mib = 2**20
    predict = cell_with("07_memory_and_batch_size", "predicted_rank0_mib = {")
    source = cell_with("07_memory_and_batch_size", "predicted_rank0_mib[part]")
    names = {"ZERO_MODEL": ModelShape(4, 512, 8, 128), "num_parameters": num_parameters}
    run_cell(predict, **names)  # the cell before the job runs as written
    p = num_parameters(4, 512, 4096, 128)
    zero = {
        "ZeRO-1": {"optimizer state": (8 * p / 2 + 4) / mib},
        "ZeRO-3": {"parameters": (4 * p / 2 + 8) / mib},
    }
    right = {"ZeRO-1 optimizer state": 8 * p / 2 / mib, "ZeRO-3 parameters": 4 * p / 2 / mib}
    assert run_cell(source, zero=zero, predicted_rank0_mib=right).count("[ok]") == 2
    for part, wrong in (("ZeRO-1 optimizer state", 8 * p / mib), ("ZeRO-3 parameters", 4 * p / mib),
                        ("ZeRO-1 optimizer state", 16 * p / 2 / mib), ("ZeRO-3 parameters", "28")):  # fmt: skip
        with pytest.raises(ExerciseError):
            run_cell(source, zero=zero, predicted_rank0_mib={**right, part: wrong})
    untouched = run_cell(source, zero=zero, predicted_rank0_mib=dict.fromkeys(right, FIXME))
    assert untouched.count("[not yet]") == 2 and "[ok]" not in untouched
