"""Tokens per expert read back from ``[moe]`` lines, and their plot (``distlab.logs.experts``)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from distlab.gpt.pretrain import MOE
from distlab.logs.experts import expert_load, imbalance, plot_tokens_per_expert


def _log(counts: list[list[int]], aux: list[float]) -> str:
    lines = ["> MoE: 4 experts per layer, ..."]
    for it, (c, a) in enumerate(zip(counts, aux, strict=True), start=1):
        for layer in (0, 1):
            lines.append(
                MOE.format(it=it, layer=layer, aux=a + layer, dropped=0, counts=" ".join(map(str, c)))
            )
        lines.append(f" iteration {it:8d}/      10 | lm loss: 5.0 |")
    return "\n".join(lines)


SKEWED = [[10, 10, 10, 10], [25, 5, 5, 5], [37, 1, 1, 1]]  # collapsing onto expert 0
BALANCED = [[10, 10, 10, 10], [11, 9, 10, 10], [10, 10, 9, 11]]


def test_expert_load_reads_one_layer_per_step():
    its, counts, aux = expert_load(_log(SKEWED, [1.0, 1.5, 2.5]), layer=1)
    assert its.tolist() == [1, 2, 3]
    assert counts.tolist() == SKEWED
    assert aux.tolist() == [2.0, 2.5, 3.5]  # layer 1's own values
    with pytest.raises(ValueError, match="no \\[moe\\] lines for layer 2"):
        expert_load(_log(SKEWED, [1.0] * 3), layer=2)


def test_imbalance_is_max_over_mean():
    assert imbalance(np.array(SKEWED)).tolist() == pytest.approx([1.0, 2.5, 3.7])
    assert imbalance(np.array(BALANCED)).max() == pytest.approx(1.1)


def test_plot_has_a_panel_per_run_and_the_imbalance():
    fig = plot_tokens_per_expert(
        {"coeff 0": _log(SKEWED, [1.0] * 3), "coeff 1e-2": _log(BALANCED, [1.0] * 3)}
    )
    axes = fig.get_axes()
    assert len(axes) == 3
    assert len(axes[0].collections) == 4  # one stacked band per expert
    ys = [line.get_ydata().tolist() for line in axes[2].get_lines()[:2]]
    assert ys[0] == pytest.approx([1.0, 2.5, 3.7]) and max(ys[1]) == pytest.approx(1.1)
