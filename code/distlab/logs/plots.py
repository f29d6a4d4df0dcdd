"""Throughput across runs, next to a reference: ms/iteration, samples/s, scaling efficiency.

Also notebook 07's memory bars: parts of each run stacked, and memory beside ms/iteration.

Rows are ``distlab.logs.megatron.throughput`` dicts (with ``efficiency`` from
``with_efficiency``); the reference is drawn hatched beside them, on its own axis scale per
panel so that the *shape* of the two series can be compared, not their absolute speed.
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt

PANELS = (
    ("ms_per_iter", "ms / iteration"),
    ("samples_per_s", "samples / s"),
    ("efficiency", "scaling efficiency"),
)


def plot_scaling(ours: dict[str, dict], reference: dict[str, dict], ours_name: str, reference_name: str):
    """Three panels; in each, our runs (solid) and the reference runs (hatched) by device count."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    bars = []
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        ref_ax = ax.twinx() if key != "efficiency" else ax
        xs = range(len(ours))
        ours_bars = ax.bar(
            [x - 0.2 for x in xs], [r[key] for r in ours.values()], 0.4, color="tab:blue", label=ours_name
        )
        ref_bars = ref_ax.bar([x + 0.2 for x in range(len(reference))], [r[key] for r in reference.values()], 0.4,
                   color="white", edgecolor="tab:orange", hatch="//", label=reference_name)  # fmt: skip
        ax.set_xticks(list(xs), [f"{k}\n({r['devices']} dev, B={r['global_batch']})" for k, r in ours.items()],
                      fontsize=7)  # fmt: skip
        ax.set_title(title)
        bars = bars or [ours_bars, ref_bars]
        if key == "efficiency":
            ax.set_ylim(0, 1.1)
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        else:
            ax.set_ylabel(ours_name, color="tab:blue", fontsize=8)
            ref_ax.set_ylabel(reference_name, color="tab:orange", fontsize=8)
    fig.legend(bars, [ours_name, reference_name], loc="lower center", ncol=2, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def stacked_bars(ax, rows: Mapping[str, Mapping[str, float]], parts: Mapping[str, str]):
    """One bar per row, named by its key: ``row[part]`` stacked bottom to top in the order of
    ``parts`` (row key -> legend label); top of bar i = sum of its parts."""
    bottom = [0.0] * len(rows)
    for key, label in parts.items():
        heights = [row[key] for row in rows.values()]
        ax.bar(list(rows), heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.legend(fontsize=8)
    return ax


def memory_and_time(
    rows: Mapping[str, Mapping], parts: Mapping[str, str], memory_label: str, estimate=None, log_time=False
):
    """The same runs twice, side by side: left, memory as ``stacked_bars`` (``row[estimate]`` as a
    black tick when given); right, ``row["ms"]`` per iteration, each bar labelled with its value."""
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(12, 4))
    if estimate is not None:
        mem_ax.plot(
            list(rows), [row[estimate] for row in rows.values()], "k_", markersize=25, label="estimate"
        )
    stacked_bars(mem_ax, rows, parts).set_ylabel(memory_label)
    time_ax.bar_label(time_ax.bar(list(rows), [row["ms"] for row in rows.values()], color="C3"), fmt="%.0f")
    time_ax.set_ylabel("ms per iteration (log scale)" if log_time else "ms per iteration")
    if log_time:
        time_ax.set_yscale("log")
    for ax in (mem_ax, time_ax):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    return fig


#: Published MFU figures to compare a run with (GPU runs; see SYLLABUS's notebook 08 references).
MFU_REFERENCES = {
    "torchtitan, Llama 3.1 8B, 8 H100 (eager..compiled)": (0.33, 0.39),
    "picotron, SmolLM-1.7B, 8 H100": (0.50, 0.50),
    "achievable bf16 GEMM on H100 (795 of 989 TFLOP/s)": (0.80, 0.80),
}


def plot_mfu(mfus: Mapping[str, float], peak_note: str):
    """One bar per run (MFU in percent), the published figures as horizontal lines or bands."""
    fig, ax = plt.subplots(figsize=(8, 3.4))
    bars = ax.bar(list(mfus), [100 * v for v in mfus.values()], color="tab:blue")
    ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
    colors = iter(("tab:orange", "tab:green", "tab:gray"))
    for label, (low, high) in MFU_REFERENCES.items():
        color = next(colors)
        if low == high:
            ax.axhline(100 * low, color=color, ls="--", lw=1, label=label)
        else:
            ax.axhspan(100 * low, 100 * high, color=color, alpha=0.25, label=label)
    ax.set_ylabel("MFU (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"model FLOPs utilisation against {peak_note}", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig
