"""The notebook's figures: step-time breakdown per run and rank, top operators, memory curve,
utilisation of every node on one time axis with the job's phases."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import matplotlib.pyplot as plt

from distlab.profiling.traces import GROUPS, Trace, communication_split, step_spans

COLOURS = {
    "computation": "tab:blue",
    "communication": "tab:red",
    "data loading": "tab:green",
    "other": "tab:gray",
}


def plot_breakdown(runs: dict[str, dict[str, Trace]], ax=None):
    """One stacked horizontal bar per (run, rank): average step time (ms) in the four groups,
    the communication share written beside each bar."""
    bars = [(f"{run} / {w}", t.groups_ms()) for run, traces in runs.items() for w, t in traces.items()]
    ax = ax or plt.subplots(figsize=(9, 0.5 * len(bars) + 1.2))[1]
    labels = [b[0] for b in bars]
    left = [0.0] * len(bars)
    for g in GROUPS:
        widths = [b[1][g] for b in bars]
        ax.barh(labels, widths, left=left, color=COLOURS[g], label=g)
        left = [a + w for a, w in zip(left, widths, strict=True)]
    for i, (_, groups) in enumerate(bars):
        total = sum(groups.values())
        ax.text(left[i], i, f"  {100 * groups['communication'] / total:.0f}% comm.", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("average step time (ms)")
    ax.set_xlim(0, max(left) * 1.25)
    # above the bars, one row: inside the axes it covered the last bars' "% comm." labels
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=len(GROUPS), fontsize=8, frameon=False)
    ax.set_title("Step-time breakdown (the plugin's Overview, grouped)", pad=24)
    return ax


def plot_overlap(runs: dict[str, Trace]):
    """Left: the last traced step of each run on one time axis, backward (blue) above the
    collectives (red); right: communication hidden under backward and exposed after it, as a
    share of the step."""
    fig, (tl, bars) = plt.subplots(1, 2, figsize=(13, 0.9 * len(runs) + 1.6), width_ratios=(3, 1))
    for i, trace in enumerate(runs.values()):
        s = step_spans(trace)[-1]
        tl.broken_barh([(a, b - a) for a, b in s.backward], (i - 0.4, 0.38), color=COLOURS["computation"])
        tl.broken_barh(
            [(a, b - a) for a, b in s.communication], (i + 0.02, 0.38), color=COLOURS["communication"]
        )
        split = communication_split(trace)
        hidden, exposed = (100 * split[k] / split["step"] for k in ("hidden", "exposed"))
        bars.barh(i, hidden, color="tab:orange", label="hidden" if i == 0 else None)
        bars.barh(
            i, exposed, left=hidden, color=COLOURS["communication"], label="exposed" if i == 0 else None
        )
        bars.text(hidden + exposed, i, f" {exposed:.0f}% exposed", va="center", fontsize=8)
    for ax in (tl, bars):
        ax.set_yticks(range(len(runs)), list(runs))
        ax.invert_yaxis()
    tl.set_xlabel("ms from the start of the last traced step (blue: backward operators, red: collectives)")
    tl.set_title("Where the all-reduces run")
    bars.set_yticklabels([])
    bars.set_xlabel("communication, % of the step")
    bars.set_xlim(0, max(bars.get_xlim()[1], 1) * 1.5)
    bars.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def _label(trace: Trace) -> str:
    """``run/profile-name / worker``, e.g. ``prof-dp1/trace / rank0``."""
    return f"{trace.path.parent.parent.name}/{trace.path.parent.name} / {trace.worker}"


def plot_top_operators(trace: Trace, n: int = 10, ax=None):
    """Horizontal bars of the ``n`` operators with the largest self time (the Operator view)."""
    rows = trace.top_operators(n)
    ax = ax or plt.subplots(figsize=(8, 0.35 * n + 1))[1]
    ax.barh([f"{r['name']} (x{r['calls']})" for r in rows], [r["host_self_duration"] / 1000 for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("self time over the traced steps (ms)")
    ax.set_title(f"Top operators, {_label(trace)}")
    return ax


def plot_memory(trace: Trace, ax=None):
    """Allocated memory over the traced steps; forward (white) and backward (shaded) of each step."""
    t, mib = trace.memory_curve()
    if not t:
        raise ValueError(f"{trace.path} holds no memory events: trace with profile_memory=True")
    ax = ax or plt.subplots(figsize=(9, 3))[1]
    ax.plot(t, mib, lw=1)
    for s in trace.steps_ms():
        ax.axvline(s["start"], color="k", lw=0.5)
        if s["backward"] is not None:
            ax.axvspan(s["backward"], s["end"], color="tab:orange", alpha=0.15)
        ax.text(s["start"], max(mib), f" {s['step']}", fontsize=7, va="top")
    ax.set_xlabel("time since the profiler started (ms); shaded: backward")
    ax.set_ylabel("allocated (MB)")
    ax.set_title(f"Memory, {_label(trace)}")
    return ax


def plot_utilisation(nodes: dict[str, dict[str, list]], phases: dict[str, float] | None = None):
    """CPU (mean and per core), job memory and, where sampled, GPU use of every node against
    seconds since the first sample; ``phases`` ({label: Unix time}) drawn as vertical lines."""
    gpu = any(k.startswith("gpu") for cols in nodes.values() for k in cols)
    panels = ["cpu", "job_rss_mib"] + (["gpu_util", "gpu_mem_mib", "gpu_power_w"] if gpu else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.1 * len(panels)), sharex=True)
    t0 = min(cols["time"][0] for cols in nodes.values() if cols.get("time"))
    for node, cols in nodes.items():
        x = [t - t0 for t in cols["time"]]
        (line,) = axes[0].plot(x, cols["cpu"], label=f"{node} mean")
        for k in (k for k in cols if k[3:].isdigit() and k.startswith("cpu")):
            axes[0].plot(x, cols[k], color=line.get_color(), lw=0.4, alpha=0.4)
        axes[1].plot(x, cols["job_rss_mib"], label=node)
        for i, p in enumerate(panels[2:], start=2):
            for k in (k for k in cols if k.startswith("gpu") and k.endswith(p[4:])):
                axes[i].plot(x, cols[k], label=f"{node} {k.split('_')[0]}")
    units = {"cpu": "CPU %", "job_rss_mib": "job RSS (MiB)", "gpu_util": "GPU %", "gpu_mem_mib": "GPU MiB",
             "gpu_power_w": "GPU W"}  # fmt: skip
    for ax, p in zip(axes, panels, strict=True):
        ax.set_ylabel(units[p])
        for k, (label, when) in enumerate((phases or {}).items()):
            ax.axvline(when - t0, color="k", ls="--", lw=0.7)
            if ax is axes[0]:  # labels at three heights, so that close phases stay readable
                lo, hi = ax.get_ylim()
                ax.text(when - t0, hi - (k % 3) * (hi - lo) / 3, f" {label}", fontsize=7, va="top")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("seconds since the first sample")
    fig.suptitle("Utilisation per node (thin lines: single cores)")
    fig.tight_layout()
    return fig


def job_phases(info: dict[str, str], tensorboard_dir: str | None = None, save_dir: str | None = None) -> dict:
    """{label: Unix time}: job start and end (``scontrol``'s StartTime/EndTime in ``info``), the
    first iteration (wall time of TensorBoard's first ``lm loss``) and every checkpoint folder."""
    phases = {}
    for label, key in (("start", "StartTime"), ("end", "EndTime")):
        if info.get(key, "Unknown") not in ("Unknown", "None", ""):
            phases[label] = datetime.fromisoformat(info[key]).timestamp()
    if tensorboard_dir:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0}).Reload()
        if "lm loss" in acc.Tags()["scalars"]:
            phases["first iteration"] = acc.Scalars("lm loss")[0].wall_time
    for folder in sorted(Path(save_dir).glob("iter_*")) if save_dir else []:
        phases[f"checkpoint {int(folder.name[5:])}"] = folder.stat().st_mtime
    return dict(sorted(phases.items(), key=lambda kv: kv[1]))
