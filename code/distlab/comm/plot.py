"""Bus bandwidth against message size, from the CSV files of ``bandwidth_bench.py`` runs.

Left: every collective (one colour per op, one line style per run, e.g. within a node vs across
nodes). Right: the hand-written ring all-reduce next to ``dist.all_reduce``. Both axes are
logarithmic: bandwidth grows with size until the link, not the per-call latency, is the limit.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from distlab.comm.bench import OPS, Row, human, read_results  # noqa: E402

_STYLES = ["-", "--", ":", "-."]


def plot_busbw(runs: dict[str, str | Path], out: str | Path, title: str = "") -> Path:
    """Draw ``runs`` (label -> CSV path) into ``out`` (PNG); return its path."""
    data: dict[str, list[Row]] = {label: read_results(path) for label, path in runs.items()}
    colours = {op: f"C{i}" for i, op in enumerate(OPS)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for style, (label, rows) in zip(_STYLES * 4, data.items(), strict=False):
        for op in OPS:
            pts = sorted((r.bytes, r.busbw_GBps) for r in rows if r.op == op)
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            n = next(r.world_size for r in rows if r.op == op)
            if op != "ring_all_reduce":
                left.plot(xs, ys, style, color=colours[op], marker="o", ms=3, label=f"{op} [{label}, n={n}]")
            if op in ("all_reduce", "ring_all_reduce"):
                right.plot(xs, ys, style, color=colours[op], marker="o", ms=3, label=f"{op} [{label}, n={n}]")
    sizes = sorted({r.bytes for rows in data.values() for r in rows})
    for ax, name in ((left, "collectives"), (right, "hand-written ring vs dist.all_reduce")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [human(s).replace(".0 ", " ") for s in sizes], fontsize=8)
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("message size S (bytes)")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("bus bandwidth (GB/s)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
