"""TensorBoard scalars of runs (``--tensorboard-dir``), read from their event files and plotted.

``pretrain_gpt.py`` writes Megatron's tags: ``lm loss``, ``learning-rate``, ``grad-norm``,
``lm loss validation``; with ``--log-timers-to-tensorboard`` also ``iteration-time`` (seconds) and
``train-step-time`` (ms); with ``--log-batch-size-to-tensorboard`` the ``batch-size``. Every tag
is indexed by iteration (and again ``... vs samples``, by consumed samples).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

Series = list[tuple[int, float]]  # (step, value)


def read_scalars(logdir: str | Path) -> dict[str, Series]:
    """tag -> [(step, value), ...] of every scalar in the event files under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = Path(logdir)
    if not any(logdir.glob("**/events.out.tfevents.*")):
        raise FileNotFoundError(
            f"no TensorBoard event files under {logdir}: was the run started with --tensorboard-dir {logdir}?"
        )
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def plot_runs(
    runs: dict[str, str | Path], tags: tuple[str, ...] = ("lm loss", "learning-rate", "iteration-time")
):
    """One panel per tag, one line per run (label -> its --tensorboard-dir); returns the figure."""
    data = {label: read_scalars(d) for label, d in runs.items()}
    fig, axes = plt.subplots(1, len(tags), figsize=(4.2 * len(tags), 3.3), squeeze=False)
    for ax, tag in zip(axes[0], tags, strict=True):
        for label, scalars in data.items():
            if tag in scalars:
                steps, values = zip(*scalars[tag], strict=True)
                ax.plot(steps, values, marker=".", label=label)
        ax.set_title(tag)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig
