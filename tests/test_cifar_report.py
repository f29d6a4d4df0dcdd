"""Scaling table from job logs: runtime = sum over epochs of the slowest rank; S = T1/TP; E = S/P."""

from __future__ import annotations

import pytest

from distlab.checks import ExerciseError
from distlab.cifar.report import check_resume, format_table, parse_log, plot_scaling, scaling_rows

ONE = """job 5 on node1: site=local
rank 0/1 node1 | epoch 1/2 | time 4.00 s | loss 1.5000 | acc 40.00% | 750.0 img/s
rank 0/1 node1 | epoch 2/2 | time 4.00 s | loss 0.9000 | acc 70.00% | 750.0 img/s
done: 2 epochs in 8.10 s on 1 ranks (1 nodes) | final acc 70.00%
"""
FOUR = "\n".join(
    f"rank {r}/4 node{1 + r // 2} | epoch {e}/2 | time {t} s | loss 1.0000 | acc 65.00% | 300.0 img/s"
    for e in (1, 2)
    for r, t in enumerate(["2.00", "2.50", "2.10", "1.90"])
)


def test_parse_and_rows(tmp_path):
    one, four = parse_log(ONE), parse_log("noise\n" + FOUR)
    assert one.world == 1 and one.runtime == 8.0 and one.final_acc == 70.0
    assert four.world == 4 and four.hosts == {"node1", "node2"} and four.runtime == 5.0  # 2 x slowest 2.50
    rows = scaling_rows({"1 process": one, "DataParallel": "needs GPUs", "DDP 2 nodes": four}, "1 process")
    assert rows[1] == {"run": "DataParallel", "skipped": "needs GPUs"}
    assert rows[2]["speedup"] == pytest.approx(8.0 / 5.0) and rows[2]["efficiency"] == pytest.approx(1.6 / 4)
    assert rows[2]["img_per_s"] == 1200.0 and rows[2]["nodes"] == 2
    text = format_table(rows)
    assert "skipped: needs GPUs" in text and "1.60" in text and "40%" in text
    assert "img/s, all ranks" in text and " 1200 " in text  # the sum of 4 ranks' 300 img/s
    plot_scaling(rows, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").stat().st_size > 1000


def test_log_without_training_says_so():
    with pytest.raises(ValueError, match="did the job train"):
        parse_log("Traceback (most recent call last):\nRuntimeError: boom\n")


def test_runs_of_different_length_are_refused():
    with pytest.raises(ValueError, match="same length"):
        scaling_rows({"a": parse_log(ONE), "b": parse_log(FOUR.split("\n")[0])}, "a")


LOSSES = {1: [1.4075, 1.4385, 1.3591, 1.4070], 2: [0.8743, 0.7776, 0.7663, 0.7604]}  # notebook 03's


def cifar_log(epochs, world: int = 4, shift: float = 0.0, stopped: bool = False) -> str:
    """A 2-node job's log as train_cifar.py prints it: every rank's line of each of ``epochs``."""
    lines = ["job 7 on node[1-2]: site=local backend=gloo procs/node=2"]
    for e in epochs:
        acc = {1: 29.10, 2: 61.20}[e]
        lines += [
            f"rank {r}/{world} node{1 + r // 2} | epoch {e}/2 | time 2.20 s | loss {LOSSES[e][r] + shift:.4f} | "
            f"acc {acc:.2f}% | 340.0 img/s"
            for r in range(world)
        ]
    if stopped:
        lines.append(
            "stopping after epoch 1 (--stop-after 1); continue with --resume --checkpoint jobs/resume.pt"
        )
    return "\n".join(lines) + "\n"


FULL, PART1, PART2 = cifar_log([1, 2]), cifar_log([1], stopped=True), cifar_log([2])


@pytest.mark.parametrize("exact", [True, False], ids=["gloo", "nccl"])
def test_resume_check_passes_a_resumed_run(exact, capsys):
    assert check_resume(PART1, PART2, FULL, exact=exact) is True
    assert capsys.readouterr().out.count("[ok]") == 4


@pytest.mark.parametrize("exact", [True, False], ids=["gloo", "nccl"])
@pytest.mark.parametrize(
    "part1,part2,match",
    [
        # part 2 without --resume: trains epochs 1-2 again from the same seed; its epoch 2 is the
        # uninterrupted one (the old check passed it, and always passed on GPU sites)
        (PART1, FULL, r"part 2: the epochs in its log: \[1, 2\] is not right; expected \[2\]"),
        (FULL, cifar_log([2]), r"part 1: the epochs in its log: \[1, 2\] is not right"),  # no --stop-after
        ("srun: error: ...\n", PART2, r"part 1: the epochs in its log: \[\] is not right"),  # part 1 failed
        (PART1, cifar_log([2], world=2), "part 2: its epochs against"),  # resumed on one node
        (cifar_log([1], world=2), PART2, "part 1: epoch 1 against"),  # part 1 on one node
        (PART1, cifar_log([2], shift=0.2), "part 2: its epochs against"),  # another run's checkpoint
    ],
    ids=["no-resume", "no-stop", "part1-failed", "part2-1-node", "part1-1-node", "other-checkpoint"],
)
def test_resume_check_fails_with_what_is_wrong(part1, part2, match, exact):
    with pytest.raises(ExerciseError, match=match):
        check_resume(part1, part2, FULL, exact=exact)


def test_resume_check_on_gloo_is_exact_on_gpus_close():
    off_by_one_digit = cifar_log([2], shift=0.0001)  # what a resume in another bucket layout printed
    with pytest.raises(ExerciseError, match="part 2: its epochs against"):
        check_resume(PART1, off_by_one_digit, FULL, exact=True)
    assert check_resume(PART1, off_by_one_digit, FULL, exact=False) is True
