"""Pictures of tensor and hybrid parallelism, drawn with matplotlib into ``images/gpt/``.

Run from the repository root (the PNGs are committed; rerun after changing this file)::

    python -m distlab.gpt.tools.diagrams    # writes images/gpt/tp_mlp.png, tp_block.png, gpipe.png, tp2_pp2_placement.png

``tp_mlp``: the MLP over 2 tensor-parallel ranks, Y = GeLU(X A + a) C + c with A split by columns
and C by rows, and the two operators between them (notebook 05 shows it before its exercise, so
it names what f and g do, not how many all-reduces a layer makes).

``tp_block``: one transformer block over 2 tensor-parallel ranks (Megatron's split). Each rank
holds half the attention heads and half the MLP columns (column-parallel: Q, K, V, fc1) then the
matching rows (row-parallel: proj, fc2). ``f`` is the identity forward and an all-reduce backward;
``g`` an all-reduce forward and the identity backward: per layer and micro-batch 2 all-reduces in its
forward, 2 in its backward.

``gpipe``: GPipe's schedule on p = 4 stages with m = 4 micro-batches, one unit of time per forward
and per backward: the idle slots (the bubble) while the pipeline fills and drains, (p - 1)/(m + p - 1)
of the step (notebook 05 shows it before its 1F1B exercise, so not 1F1B's order).

``tp2_pp2_placement``: world 4 = TP 2 x PP 2 x DP 1 on 2 nodes x 2 GPUs, placed in Megatron's
rank order (``Layout``): a tensor-parallel pair inside each node, the pipeline across.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from distlab import REPO_ROOT  # noqa: E402
from distlab.gpt.layout import Layout  # noqa: E402

OP = "#fdd49e"  # f / g operators
COMM = "#e34a33"


def _box(ax, x: float, y: float, w: float, h: float, text: str, face: str, size: int = 8) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=face, edgecolor="black"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def _arrow(
    ax, a: tuple[float, float], b: tuple[float, float], colour: str = "black", style: str = "-|>"
) -> None:
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=10, color=colour, lw=1.2))


# (label, width, kind): kind "op" = f/g operator (spans both ranks), "rank" = per-rank shard
_BLOCK = [
    ("X\n(b, s, h)", 0.9, "both"),
    ("LN", 0.5, "both"),
    ("f", 0.4, "op"),
    ("Q K V\nheads {heads}\n(column)", 1.2, "rank"),
    ("attention\nheads {heads}", 1.1, "rank"),
    ("proj\n(row)\npartial sum", 1.1, "rank"),
    ("g", 0.4, "op"),
    ("+ X", 0.5, "both"),
    ("LN", 0.5, "both"),
    ("f", 0.4, "op"),
    ("fc1 cols\n{cols}\n(column)", 1.2, "rank"),
    ("GeLU", 0.6, "rank"),
    ("fc2 rows\n{cols}\n(row)", 1.1, "rank"),
    ("g", 0.4, "op"),
    ("+\nout", 0.5, "both"),
]


# the MLP alone, as notebook 05's exercise writes it
_MLP = [
    ("X\n(b, s, h)\nthe same\non both", 1.1, "both"),
    ("f", 0.4, "op"),
    ("X A_r + a_r\ncolumns {cols}\n(b, s, F/t)", 1.5, "rank"),
    ("GeLU\n= H_r", 0.8, "rank"),
    ("Z_r = H_r C_r\nrows {cols}\npartial (b, s, h)", 1.6, "rank"),
    ("g", 0.4, "op"),
    ("Y = Z_0 + Z_1\n+ c\n(b, s, h)", 1.2, "both"),
]


def _draw_ranks(ax, block: list, heads: int, ffn: int) -> float:
    """Two rows of boxes (rank 0 on top) for ``block``; the operators span both; the x reached."""
    x, gap = 0.0, 0.25
    for label, w, kind in block:
        for r, y in enumerate((1.6, 0.2)):
            hs = f"{r * heads // 2}-{(r + 1) * heads // 2 - 1}"
            cols = f"{r * ffn // 2}-{(r + 1) * ffn // 2 - 1}"
            text = label.format(heads=hs, cols=cols)
            face = {"op": OP, "rank": f"C{r}", "both": "#f0f0f0"}[kind]
            if kind != "op":
                _box(
                    ax, x, y, w, 1.0, text, face if kind == "both" else matplotlib.colors.to_hex(face) + "55"
                )
        if kind == "op":
            _box(ax, x, 0.2, w, 2.4, label, OP, size=12)
            name = "identity fwd\nall-reduce bwd" if label == "f" else "all-reduce fwd\nidentity bwd"
            ax.text(x + w / 2, 2.85, name, ha="center", va="bottom", fontsize=7, color=COMM)
        if x > 0:
            for y in (2.1, 0.7):
                _arrow(ax, (x - gap, y), (x, y))
        x += w + gap
    ax.text(-0.2, 2.1, "rank 0", ha="right", va="center", fontsize=10, color="C0")
    ax.text(-0.2, 0.7, "rank 1", ha="right", va="center", fontsize=10, color="C1")
    ax.set_xlim(-1.0, x)
    ax.set_ylim(0, 3.5)
    ax.axis("off")
    return x


def draw_tp_block(out_dir: Path, heads: int = 4, ffn: int = 256) -> Path:
    """One block over 2 tensor-parallel ranks, rank 0 on top."""
    fig, ax = plt.subplots(figsize=(14, 3.6))
    _draw_ranks(ax, _BLOCK, heads, ffn)
    ax.set_title(
        f"One transformer block over tensor-parallel size 2 ({heads} heads, MLP width {ffn}): "
        "4 all-reduces per layer and micro-batch (g twice in its forward, f twice in its backward)",
        fontsize=10,
    )
    return _save(fig, out_dir / "tp_block.png")


def draw_tp_mlp(out_dir: Path, ffn: int = 32) -> Path:
    """The MLP Y = GeLU(X A + a) C + c over 2 tensor-parallel ranks, rank 0 on top, with f and g."""
    fig, ax = plt.subplots(figsize=(10, 3.6))
    _draw_ranks(ax, _MLP, 0, ffn)
    ax.set_title(
        f"The MLP Y = GeLU(X A + a) C + c over t = 2 ranks (F = {ffn} hidden units): A split by columns,\n"
        "C by rows; f where X enters the tensor-parallel region, g where the partial sums Z_r leave it",
        fontsize=10,
    )
    return _save(fig, out_dir / "tp_mlp.png")


def gpipe_slots(p: int, m: int) -> dict[tuple[str, int, int], int]:
    """GPipe with one unit of time per pass: (kind, micro-batch, stage) -> its slot. F_i runs on
    stage s at slot s + i; the last stage starts B_0 after its last forward, and B_i reaches stage s
    p - 1 - s slots later."""
    slots = {("F", i, s): s + i for s in range(p) for i in range(m)}
    slots.update({("B", i, s): (m + p - 1) + (p - 1 - s) + i for s in range(p) for i in range(m)})
    return slots


def draw_gpipe(out_dir: Path, p: int = 4, m: int = 4) -> Path:
    """GPipe's schedule on ``p`` stages and ``m`` micro-batches, its idle slots marked."""
    slots, end = gpipe_slots(p, m), 2 * (m + p - 1)
    fig, ax = plt.subplots(figsize=(10, 0.55 * p + 1.2))
    busy = {(s, t) for (_, _, s), t in slots.items()}
    for (kind, i, s), t in slots.items():
        face = "#6baed6" if kind == "F" else "#fd8d3c"
        _box(ax, t + 0.05, p - 1 - s + 0.1, 0.9, 0.8, f"{kind}{i}", face, size=8)
    for s in range(p):
        for t in range(end):
            if (s, t) not in busy:
                ax.add_patch(plt.Rectangle((t + 0.05, p - 1 - s + 0.1), 0.9, 0.8, facecolor="#f0f0f0",
                                           edgecolor="#bbbbbb", hatch="///"))  # fmt: skip
        ax.text(-0.2, p - 1 - s + 0.5, f"stage {s}", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.2, end)
    ax.set_ylim(-0.6, p)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.text(end / 2, -0.35, "time: one slot per forward (F, blue) or backward (B, orange) of one micro-batch; "
            "hatched: idle, the bubble", ha="center", fontsize=8)  # fmt: skip
    ax.set_title(
        f"GPipe, p = {p} stages, m = {m} micro-batches: each stage idles {p - 1} x 2 of {end} slots, "
        f"(p - 1)/(m + p - 1) = {p - 1}/{m + p - 1} of the step",
        fontsize=10,
    )
    return _save(fig, out_dir / "gpipe.png")


def draw_placement(out_dir: Path, nodes: int = 2, per_node: int = 2, tp: int = 2, pp: int = 2) -> Path:
    """Ranks of TP x PP on ``nodes`` x ``per_node`` devices in Megatron's order, with their groups."""
    layout = Layout(nodes * per_node, tp, pp)
    fig, ax = plt.subplots(figsize=(9, 3.8))
    pos, node_w = {}, 1.8 * per_node + 0.2
    for n in range(nodes):
        x0 = n * (node_w + 0.8)
        ax.add_patch(FancyBboxPatch((x0, 0), node_w, 2.0, boxstyle="round,pad=0.05", facecolor="#f7f7f7"))
        ax.text(x0 + 0.1, 1.8, f"node{n + 1}", ha="left", fontsize=11, weight="bold")
        for local in range(per_node):
            rank = n * per_node + local
            t, d, p = (layout.coord(rank, dim) for dim in ("tp", "dp", "pp"))
            x = x0 + 0.3 + local * 1.8
            face = matplotlib.colors.to_hex(f"C{p}") + "66"
            _box(ax, x, 0.45, 1.2, 1.1, f"GPU {local}: rank {rank}\ntp {t}  pp {p}  dp {d}", face, size=8)
            pos[rank] = (x, x + 1.2)
    for group in layout.groups("tp"):
        (_, a), (b, _) = pos[group[0]], pos[group[-1]]
        _arrow(ax, (a, 1.0), (b, 1.0), COMM, "<|-|>")
        ax.text((a + b) / 2, 0.12, "TP all-reduce, inside the node", ha="center", fontsize=7, color=COMM)
    for group in layout.groups("pp"):
        a, b = sum(pos[group[0]]) / 2, sum(pos[group[-1]]) / 2
        ax.add_patch(FancyArrowPatch((a, 1.6), (b, 1.6), arrowstyle="-|>", mutation_scale=10, color="C2",
                                     connectionstyle="arc3,rad=-0.25"))  # fmt: skip
        ax.text((a + b) / 2, 1.6 + 0.125 * (b - a) + 0.05, f"PP send/recv {group}", ha="center", fontsize=7,
                color="C2")  # fmt: skip
    ax.set_xlim(-0.3, nodes * (node_w + 0.8))
    ax.set_ylim(-0.1, 2.9)
    ax.axis("off")
    ax.set_title(f"TP={tp} x PP={pp} x DP={layout.dp} on {nodes} nodes x {per_node} GPUs (Megatron rank order)",
                 fontsize=10)  # fmt: skip
    return _save(fig, out_dir / "tp2_pp2_placement.png")


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else REPO_ROOT / "images" / "gpt"
    print(draw_tp_mlp(out_dir))
    print(draw_tp_block(out_dir))
    print(draw_gpipe(out_dir))
    print(draw_placement(out_dir))


if __name__ == "__main__":
    main()
