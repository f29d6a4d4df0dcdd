"""Before/after pictures of the collectives, drawn with matplotlib into ``images/collectives/``.

Run from the repository root (the PNGs are committed; rerun after changing this file)::

    python -m distlab.comm.diagrams            # writes images/collectives/<name>.png

Each rank is a row of cells. A cell's colour is the rank its data came from; a grey cell
marked with a sum holds a reduction of the ranks named in it; an empty cell is a buffer whose
content does not matter.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from distlab import REPO_ROOT  # noqa: E402

N = 4  # ranks drawn
Cell = tuple[str, str]  # (text, colour); colour "" = empty buffer
SUM_COLOUR = "#bdbdbd"


def _c(rank: int, text: str) -> Cell:
    return text, f"C{rank}"


def _sum(text: str) -> Cell:
    return text, SUM_COLOUR


def _all(prefix: str) -> str:
    return "+".join(f"{prefix}{i}" for i in range(N))


EMPTY: Cell = ("", "")

# name -> (title, before[rank] -> cells, after[rank] -> cells)
DIAGRAMS: dict[str, tuple[str, list[list[Cell]], list[list[Cell]]]] = {
    "broadcast": (
        "broadcast(src=0): rank 0's tensor to everyone",
        [[_c(0, "a")]] + [[EMPTY]] * (N - 1),
        [[_c(0, "a")]] * N,
    ),
    "scatter": (
        "scatter(src=0): chunk i of rank 0 to rank i",
        [[_c(0, f"a{i}") for i in range(N)]] + [[EMPTY] * N] * (N - 1),
        [[_c(0, f"a{r}")] for r in range(N)],
    ),
    "gather": (
        "gather(dst=0): every rank's tensor to rank 0",
        [[_c(r, f"x{r}")] for r in range(N)],
        [[_c(i, f"x{i}") for i in range(N)]] + [[_c(r, f"x{r}")] for r in range(1, N)],
    ),
    "reduce": (
        "reduce(dst=0, SUM): the sum lands on rank 0 only",
        [[_c(r, f"x{r}")] for r in range(N)],
        [[_sum(_all("x"))]] + [[EMPTY] for _ in range(N - 1)],
    ),
    "all_reduce": (
        "all_reduce(SUM): every rank gets the sum",
        [[_c(r, f"x{r}")] for r in range(N)],
        [[_sum(_all("x"))]] * N,
    ),
    "all_gather": (
        "all_gather: every rank gets every rank's tensor",
        [[_c(r, f"x{r}")] for r in range(N)],
        [[_c(i, f"x{i}") for i in range(N)]] * N,
    ),
    "reduce_scatter": (
        "reduce_scatter(SUM): rank r gets the sum of everyone's chunk r",
        [[_c(r, f"x{r}{j}") for j in range(N)] for r in range(N)],
        [[_sum("+".join(f"x{i}{r}" for i in range(N)))] for r in range(N)],
    ),
    "all_to_all": (
        "all_to_all: chunk j of rank r goes to rank j (a transpose)",
        [[_c(r, f"x{r}{j}") for j in range(N)] for r in range(N)],
        [[_c(i, f"x{i}{r}") for i in range(N)] for r in range(N)],
    ),
}


def _draw_side(ax, x0: float, cells_per_rank: list[list[Cell]], width: int, heading: str) -> None:
    ax.text(x0 + width / 2, N + 0.1, heading, ha="center", va="bottom", fontsize=11)
    for r, cells in enumerate(cells_per_rank):
        y = N - 1 - r
        ax.text(x0 - 0.15, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=10)
        cell_w = width / len(cells)
        for j, (text, colour) in enumerate(cells):
            face = colour if colour else "white"
            ax.add_patch(
                Rectangle(
                    (x0 + j * cell_w, y),
                    cell_w,
                    0.8,
                    facecolor=face,
                    edgecolor="black",
                    alpha=0.75 if colour else 1.0,
                    linestyle="-" if colour else ":",
                )
            )
            size = 10 if len(text) < 8 else 7
            ax.text(x0 + (j + 0.5) * cell_w, y + 0.4, text, ha="center", va="center", fontsize=size)


def draw(name: str, out_dir: Path) -> Path:
    """Draw one collective's before/after picture into ``out_dir/<name>.png``."""
    title, before, after = DIAGRAMS[name]
    width = 4
    fig, ax = plt.subplots(figsize=(8, 3.2))
    _draw_side(ax, 1.0, before, width, "before")
    _draw_side(ax, 1.0 + width + 2.2, after, width, "after")
    ax.add_patch(
        FancyArrowPatch(
            (1.0 + width + 0.3, N / 2), (1.0 + width + 1.3, N / 2), arrowstyle="-|>", mutation_scale=20
        )
    )
    ax.set_xlim(-0.6, 2 * width + 3.4)
    ax.set_ylim(-0.3, N + 0.7)
    ax.axis("off")
    ax.set_title(title, fontsize=12)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else REPO_ROOT / "images" / "collectives"
    for name in DIAGRAMS:
        print(draw(name, out_dir))


if __name__ == "__main__":
    main()
