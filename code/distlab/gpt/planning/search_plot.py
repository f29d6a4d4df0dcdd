"""The planner's search drawn: predicted throughput against predicted peak memory per GPU.

One point per layout the engine accepts (tokens/s/GPU = B s / (t W), peak from the estimator):
those within the budget coloured by tp, those over it grey ticks up to twice the budget; the budget a vertical line. The
layouts the engine refuses have no estimate (the estimator applies the same rules), so they are
marked as a count per reason in the corner, each with the engine's own message shortened.
"""

from __future__ import annotations

from distlab.gpt.planning.dry_run import GiB
from distlab.gpt.planning.planner import Candidate, Refused, refusal_kinds


def plot_search(
    candidates: list[Candidate], refused: list[Refused] = (), ax=None, budget_gib: float | None = None
):
    """Draw the search on ``ax`` (a new figure if None) and return the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.6))
    fit = [c for c in candidates if c.fits]
    over = [c for c in candidates if not c.fits]
    sc = None
    if fit:
        sc = ax.scatter([c.peak / GiB for c in fit], [c.prediction.tokens_per_s_per_device for c in fit],
                        c=[c.layout.tp for c in fit], cmap="viridis", vmin=1, vmax=8, s=18,
                        label=f"fits ({len(fit)})")  # fmt: skip
    if over:  # no step predicted for them: drawn at the bottom, by memory alone
        bottom = min((c.prediction.tokens_per_s_per_device for c in fit), default=1.0) * 0.9
        ax.scatter([c.peak / GiB for c in over], [bottom] * len(over), marker="|", color="0.6",
                   label=f"does not fit ({len(over)}): no step predicted")  # fmt: skip
    budget = budget_gib or (candidates[0].budget / GiB if candidates else None)
    if budget:
        ax.axvline(budget, color="r", ls="--", lw=1, label=f"budget {budget:.0f} GiB")
        ax.set_xlim(0, 2 * budget)  # the nearest that do not fit; the others lie beyond
    if refused:  # the engine's reasons, numbers masked: "--num-layers N is not divisible by ..."
        kinds = refusal_kinds(refused).items()
        text = "\n".join(f"{len(same)} refused by the engine: {kind}" for kind, same in kinds)
        ax.set_title(text, fontsize=7, color="C3", loc="left")
    ax.set_xlabel("predicted peak of a GPU (GiB)")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.legend(fontsize=7, loc="upper right")
    if sc is not None:
        ax.figure.colorbar(sc, ax=ax, label="tp")
    return ax
