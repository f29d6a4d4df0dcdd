"""Throughput across runs, next to a reference: ms/iteration, samples/s, scaling efficiency.

Rows are ``distlab.logs.megatron.throughput`` dicts (with ``efficiency`` from
``with_efficiency``); the reference is drawn hatched beside them, on its own axis scale per
panel so that the *shape* of the two series can be compared, not their absolute speed.
"""

from __future__ import annotations

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
