"""Tokens per expert from a MoE run's log, and the plot of them per step (notebook 09).

Each logged iteration prints one ``[moe]`` line per MoE layer (``distlab.logs.formats.MOE``):
the tokens routed to each expert over all micro-batches and data-parallel ranks. For one layer,
with c_i the tokens of expert i at a step::

    imbalance = max_i c_i / mean_i c_i         1 when balanced, E when one expert takes all

which is what the load-balancing loss (``--moe-aux-loss-coeff``) pushes towards 1, and what
sets a step's time under expert parallelism: every rank waits for the busiest expert.
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np

from distlab.logs.formats import tokens_per_expert


def expert_load(text: str, layer: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer's ``(iterations (n,), tokens per expert (n, E), load_balancing_loss (n,))`` from
    a log's ``[moe]`` lines (the last of each iteration wins, e.g. after a restart)."""
    rows = {r["it"]: r for r in tokens_per_expert(text) if r["layer"] == layer}
    if not rows:
        raise ValueError(f"no [moe] lines for layer {layer} in this log: was the run given --num-experts?")
    its = np.array(sorted(rows))
    counts = np.array([rows[i]["counts"] for i in its])
    return its, counts, np.array([rows[i]["aux"] for i in its])


def imbalance(counts: np.ndarray) -> np.ndarray:
    """``max_i c_i / mean_i c_i`` of each step (rows of ``counts``, (n, E))."""
    return counts.max(axis=1) / counts.mean(axis=1)


def plot_tokens_per_expert(logs: Mapping[str, str], layer: int = 0):
    """One panel per run (label -> log text): each expert's tokens per step, stacked; then one
    panel with every run's imbalance per step (1 = balanced)."""
    fig, axes = plt.subplots(1, len(logs) + 1, figsize=(4.2 * (len(logs) + 1), 3.6))
    for ax, (label, text) in zip(axes, logs.items(), strict=False):
        its, counts, _ = expert_load(text, layer)
        ax.stackplot(its, counts.T, labels=[f"expert {e}" for e in range(counts.shape[1])])
        ax.set_title(f"{label}: tokens per expert", fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylim(0, counts.sum(axis=1).max())
    axes[0].set_ylabel(f"layer {layer}: tokens (stacked)")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=7)
    last = axes[-1]
    for label, text in logs.items():
        its, counts, _ = expert_load(text, layer)
        last.plot(its, imbalance(counts), label=label)
    last.axhline(1.0, color="grey", lw=0.8, ls=":")
    last.set_title("imbalance: max / mean tokens per expert", fontsize=9)
    last.set_xlabel("iteration")
    last.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
