"""Scaling table from job logs: runtime = sum over epochs of the slowest rank; S = T1/TP; E = S/P."""

from __future__ import annotations

import pytest

from distlab.cifar.report import format_table, parse_log, plot_scaling, scaling_rows

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
    plot_scaling(rows, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").stat().st_size > 1000


def test_log_without_training_says_so():
    with pytest.raises(ValueError, match="did the job train"):
        parse_log("Traceback (most recent call last):\nRuntimeError: boom\n")


def test_runs_of_different_length_are_refused():
    with pytest.raises(ValueError, match="same length"):
        scaling_rows({"a": parse_log(ONE), "b": parse_log(FOUR.split("\n")[0])}, "a")
