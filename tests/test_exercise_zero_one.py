"""Notebook 07's write-it-yourself exercise (``distlab.exercises.zero_one``): one ZeRO-1 AdamW step
(reduce-scatter and average, AdamW on the own shard, all-gather) and the optimizer state per rank.

The learner's file is the notebook's ``%%writefile`` cell (the stub) or the solution notebook's; the
typical wrong answers (no all-gather, the whole vector on every rank with its own gradient, a sum,
plain data parallelism's whole-model state) run on 2 spawned gloo ranks against torch's AdamW on one
process and are told wrong with hints that hold none of the solution's code; the right one passes
(3.7e-6 of the reference's change against a tolerance of 1e-4; the closest wrong answer, a sum, is
7.5e-3 off and told by its gradient shard) and keeps half of AdamW's state. The prediction cells
(the state per rank; rank 0's ZeRO-1 state and ZeRO-3 parameters in the DeepSpeed job) run as written.
"""

from __future__ import annotations

import pytest

from distlab.checks import FIXME, ExerciseError
from distlab.exercises import zero_one
from tests.test_exercise_ddp_by_hand import (
    assert_hint_hides,
    cell_with,
    job_file,
    run_cell,
    variant,
    written_file,
)

pytestmark = pytest.mark.timeout(600)
__all__ = ["job_file"]  # the fixture, used by name


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
