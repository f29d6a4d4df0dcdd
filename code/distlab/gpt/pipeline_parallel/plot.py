"""Gantt charts of recorded pipeline timelines (``timeline.py``), with their bubbles."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from distlab.gpt.pipeline_parallel.timeline import bubble_summary, event_label, load_timeline


def plot_timelines(timelines: Sequence[dict | str | Path], path: str | Path | None = None):
    """One Gantt chart per timeline (stage 0 on top, F blue, B orange, micro-batch numbers; with
    interleaving odd chunks lighter, labels ``chunk.micro-batch``).

    Accepts gathered dicts or JSON paths; saves a PNG when ``path`` is given; returns the figure.
    """
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    tls = [load_timeline(t) if isinstance(t, (str, Path)) else t for t in timelines]
    fig, axes = plt.subplots(
        len(tls), 1, figsize=(11, 1.2 + 0.6 * sum(t["stages"] for t in tls)), squeeze=False
    )
    colors = {("F", 0): "#4c72b0", ("B", 0): "#dd8452", ("F", 1): "#8fb0e0", ("B", 1): "#f0b48a"}
    for ax, tl in zip(axes[:, 0], tls, strict=True):
        t_min = min(e["start"] for e in tl["events"])
        span = (max(e["end"] for e in tl["events"]) - t_min) * 1e3
        for e in tl["events"]:
            start, width = (e["start"] - t_min) * 1e3, (e["end"] - e["start"]) * 1e3  # ms
            color = colors[e["kind"], e.get("chunk", 0) % 2]
            ax.barh(e["stage"], width, left=start, color=color, edgecolor="black", linewidth=0.5)
            if width > 0.02 * span:  # label bars wide enough to read
                ax.text(
                    start + width / 2,
                    e["stage"],
                    event_label(e, tl.get("chunks", 1)),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        ax.set_yticks(range(tl["stages"]), [f"stage {s}" for s in range(tl["stages"])])
        ax.invert_yaxis()
        ax.set_xlabel("time in the step (ms)")
        ax.set_title(bubble_summary(tl), fontsize=9)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig
