"""TensorBoard scalars: written by the engine's TensorBoardLog, read back from the event files."""

from __future__ import annotations

import pytest

from distlab.gpt.arguments import parse_args
from distlab.gpt.arguments.to_configs import logging_config
from distlab.gpt.training.log import TensorBoardLog
from distlab.logs.tensorboard import plot_runs, read_scalars


def _write(folder, losses):
    args = parse_args(["--tensorboard-dir", str(folder), "--log-timers-to-tensorboard"])
    tb = TensorBoardLog(logging_config(args), enabled=True)
    for it, loss in enumerate(losses, start=1):
        tb.training(it, 8 * it, loss=loss, lr=1e-3 / it, loss_scale=1.0, grad_norm=None, iter_ms=250.0,
                    timers={"train-step": 200.0})  # fmt: skip
    tb.close()


def test_scalars_round_trip_and_plot(tmp_path):
    _write(tmp_path / "a", [8.0, 7.5, 7.0])
    _write(tmp_path / "b", [8.0, 7.0])
    a = read_scalars(tmp_path / "a")
    assert a["lm loss"] == [(1, 8.0), (2, 7.5), (3, 7.0)]
    assert a["lm loss vs samples"][-1] == (24, 7.0)
    assert a["iteration-time"][0] == (1, pytest.approx(0.25))
    assert a["learning-rate"][1] == (2, pytest.approx(5e-4))
    fig = plot_runs({"a": tmp_path / "a", "b": tmp_path / "b"})
    assert [len(ax.lines) for ax in fig.axes] == [2, 2, 2]


def test_missing_event_files_name_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tensorboard-dir"):
        read_scalars(tmp_path)
