"""distlab.logs.hangs: notebook 12's readers of hang and straggler reports, and its exercise check
(right passes, untouched waits, wrong fails)."""

from __future__ import annotations

import pytest

from distlab.checks import FIXME, ExerciseError
from distlab.gpt.pretrain import HANG
from distlab.gpt.training.straggler import STRAGGLER, STRAGGLER_RANKS
from distlab.logs import hangs


def straggler_log(slow: int) -> str:
    lines = []
    for it in (10, 20, 30):
        tf = {r: (1e-3 if r == slow and it > 10 else 4e-3 + r * 1e-4) for r in range(4)}
        ranked = sorted(tf, key=tf.get)
        lines.append(STRAGGLER.format(
            iteration=it, min_ms=3.0, min_rank=ranked[-1], max_ms=9.0, max_rank=ranked[0],
            min_tf=tf[ranked[0]], min_tf_rank=ranked[0], max_tf=tf[ranked[-1]], max_tf_rank=ranked[-1],
        ))  # fmt: skip
        for which, how, part in (("Bottom", "lowest ", ranked[:2]), ("Top   ", "highest", ranked[2:])):
            pairs = " ".join(f"{tf[r]:.3E}/{r}," for r in part)
            lines.append(STRAGGLER_RANKS.format(which=which, n=2, how=how, pairs=pairs))
    return "\n".join(lines) + "\n"


def test_straggler_reports_give_every_ranks_throughput_and_the_slowest():
    log = straggler_log(slow=2)
    series = hangs.rank_tflops(log)
    assert sorted(series) == [0, 1, 2, 3] and [it for it, _ in series[2]] == [10, 20, 30]
    assert series[2][1][1] == pytest.approx(1e-3) and series[2][0][1] == pytest.approx(4.2e-3)
    assert hangs.slowest_ranks(log, after=10) == [2, 2]
    assert hangs.lowest_throughput_rank(log, after=10) == 2 and hangs.lowest_throughput_rank(log) == 2
    assert hangs.lowest_throughput_rank("no report") is None


def test_hang_report_readers():
    log = HANG.format(iteration=8, timeout_s=6.0, ranks="2") + "\n"
    log += "> hang: ranks [2] did not join gloo:all_reduce #31 of group 3 (dp) [0, 2], sizes [[4]]: rank 2 on node2 (pid 8)\n"
    assert hangs.hung_ranks(log) == [2] and hangs.hung_ranks("nothing") is None
    assert hangs.missed_collectives(log * 2) == ["gloo:all_reduce #31 of group 3 (dp) [0, 2], sizes [[4]]"]


def test_diagnose_hang_report_reader():
    """diagnose_hang.py's lines (tests/test_hang_report_nccl_dumps.py reads its real output)."""
    report = (
        "no dump from ranks {0, 3}: frozen, dead or killed before the others' timeout (fr)\n"
        "2 of 4 ranks wrote a flight record in fr\n"
    )
    assert hangs.ranks_without_dump(report) == [0, 3]
    assert hangs.ranks_without_dump("4 of 4 ranks wrote a flight record in fr\n") == []
    assert hangs.ranks_without_dump("no flight records (rank_<N>) in fr yet: ...") is None


def test_the_exercise_check(tmp_path, capsys):
    (tmp_path / ".answer-7").write_text("straggler 3\n")
    assert hangs.check_fault(("straggler", 3), 7, folder=tmp_path) is True
    assert hangs.check_fault((FIXME, FIXME), 7, folder=tmp_path) is False
    assert "[not yet]" in capsys.readouterr().out
    with pytest.raises(ExerciseError, match="diagnose_hang.py"):
        hangs.check_fault(("hang", 3), 7, folder=tmp_path)
    with pytest.raises(ExerciseError):
        hangs.check_fault(("straggler", 1), 7, folder=tmp_path)
    assert hangs.check_fault((FIXME, FIXME), None) is False
