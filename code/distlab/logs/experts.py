"""Tokens per expert from a MoE run's log, and the plot of them per step (notebook 09).

Each logged iteration prints one ``[moe]`` line per MoE layer (``distlab.gpt.pretrain.MOE``):
the tokens routed to each expert over all micro-batches and data-parallel ranks. For one layer,
with c_i the tokens of expert i at a step::

    imbalance = max_i c_i / mean_i c_i         1 when balanced, at most E / k with top-k routing

(the N tokens fill k N slots, mean k N / E per expert, and an expert takes each token at most
once, c_i <= N: E / k is k experts taking every token; E only with top-1), which is what the
load-balancing loss (``--moe-aux-loss-coeff``) pushes towards 1, and what
sets a step's time under expert parallelism: every rank waits for the busiest expert.
:func:`check_expert_budget` is the check of notebook 09's exercise (experts and a parameter budget).
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np

from distlab.checks import FIXME, check
from distlab.gpt.pretrain import MOE
from distlab.logs.megatron import layout_and_completion, parameter_counts

BUDGET_HINT = (
    "parameters per rank = the dense part (embeddings, attention, norms, routers) + (E / ep) x one "
    "expert's; ep divides the data-parallel size; read the '> MoE:' and 'number of parameters' lines"
)


def tokens_per_expert(text: str) -> list[dict]:
    """Every :data:`~distlab.gpt.pretrain.MOE` line of a log, with ``counts`` as a list of ints."""
    return [{**f, "counts": [int(c) for c in f["counts"].split()]} for f in MOE.parse(text)]


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


def experts_and_parameters(text: str) -> tuple[int, int, bool]:
    """(experts per layer in the last ``[moe]`` line, most parameters on a model-parallel rank,
    True when the last iteration line was printed) of one run's log; 0 where a line is missing."""
    rows = tokens_per_expert(text)
    return (
        len(rows[-1]["counts"]) if rows else 0,
        max(parameter_counts(text).values(), default=0),
        layout_and_completion(text)[1],
    )


def check_expert_budget(
    text: str | None, *, num_experts: int, max_parameters: int, name: str = "the exercise run"
) -> bool:
    """``check`` that the run of log ``text`` (None: not submitted, untouched) trained to the end
    with ``num_experts`` experts per layer and at most ``max_parameters`` parameters per rank."""
    answer = FIXME if text is None else experts_and_parameters(text)
    return check(
        f"{name}: (experts per layer, parameters per rank, trained to the end)",
        answer,
        ok=lambda a: a[0] == num_experts and 0 < a[1] <= max_parameters and a[2],
        hint=f"{num_experts} experts per layer, at most {max_parameters:,} parameters per rank; "
        + BUDGET_HINT,
    )
