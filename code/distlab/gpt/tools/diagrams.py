"""Pictures of data, tensor, pipeline and hybrid parallelism, drawn with matplotlib into ``images/gpt/``.

Run from the repository root (the PNGs are committed; rerun after changing this file)::

    python -m distlab.gpt.tools.diagrams    # writes every picture below into images/gpt/

``dp_step`` (notebook 04, before its first data-parallel run): one step of data parallelism on 2 ranks,
each its own micro-batches through its full copy of the model; the last micro-batch's backward fills
gradient buckets (last layers first), each bucket all-reduced (averaged) while backward goes on, as
``--overlap-grad-reduce`` does; then the same optimizer step on every rank.

``tp_mlp``: the MLP over 2 tensor-parallel ranks, Y = GeLU(X A + a) C + c with A split by columns
and C by rows, and the two operators between them (notebook 05 shows it before its exercise, so
it names what f and g do, not how many all-reduces a layer makes).

``tp_block``: one transformer block over 2 tensor-parallel ranks (Megatron's split). Each rank
holds half the attention heads and half the MLP columns (column-parallel: Q, K, V, fc1) then the
matching rows (row-parallel: proj, fc2). ``f`` is the identity forward and an all-reduce backward;
``g`` an all-reduce forward and the identity backward: per layer and micro-batch 2 all-reduces in its
forward, 2 in its backward.

``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``: one step of m = 8 micro-batches on p = 4 stages,
one unit of time per forward and per backward of a stage (a chunk's pass 1/v of it), every pass as
soon as its input is there, drawn to one time scale. GPipe and 1F1B (Megatron's order: p - s - 1
warm-up forwards on stage s) idle (p - 1)/(m + p - 1) of the step, (p - 1)/m of the ideal time 2m
(Narayanan et al. 2021, 2.2.1); GPipe keeps all m micro-batches' activations, 1F1B at most p - s.
Interleaved 1F1B (v = 2 chunks per rank, ``interleaved_order``) idles (p - 1)/(v m + p - 1) of the
step, (1/v)(p - 1)/m of the ideal time (2.2.2). Notebook 05 shows GPipe before its 1F1B exercise,
the other two after it.

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
from distlab.gpt.pipeline_parallel.interleaved import interleaved_order  # noqa: E402

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


def draw_dp_step(out_dir: Path, micro: int = 2) -> Path:
    """One data-parallel step on 2 ranks, each with ``micro`` micro-batches (gradient accumulation):
    rank r runs its own samples through its full copy of the model (4 layers); the last micro-batch's
    backward fills gradient buckets, last layers first, and each bucket's all-reduce averages it over
    the ranks while backward goes on (``--overlap-grad-reduce``); then both take the same optimizer step."""
    fig, ax = plt.subplots(figsize=(13, 4.4))
    rows, band = (2.7, 0.0), (1.15, 0.9)  # rank 0's and rank 1's compute rows; the all-reduces between
    for r, y in enumerate(rows):
        ax.text(-0.2, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=10, color=f"C{r}")
        _box(ax, 0.0, y, 1.6, 0.8, "W: layers 1-4\na full copy, equal\non every rank", "#f0f0f0", size=7)
        x = 1.8
        for k in range(micro):
            ax.text(x + 0.6, y + 0.85 if r == 0 else y - 0.05, f"samples of\nmicro-batch {r * micro + k}",
                    ha="center", va="bottom" if r == 0 else "top", fontsize=7, color=f"C{r}")  # fmt: skip
            _box(ax, x, y, 1.2, 0.8, "forward", F_FACE)
            x += 1.3
            if k < micro - 1:
                _box(ax, x, y, 1.7, 0.8, "backward: gradients\naccumulate, no\ncommunication", B_FACE, size=7)
                x += 1.8
        for layers in ("4-3", "2-1"):
            _box(ax, x, y, 1.0, 0.8, f"backward\nlayers {layers}", B_FACE, size=7)
            x += 1.1
        _box(
            ax, x + 1.1, y, 1.8, 0.8, "optimizer step\nW -= lr x Adam(g)\nthe same on both", "#a1d99b", size=7
        )
    x_b = 1.8 + micro * 1.3 + (micro - 1) * 1.8  # where the last micro-batch's backward starts
    for k, start in enumerate((x_b + 1.05, x_b + 2.15)):  # each bucket once its last gradient is there
        layers = ("4-3", "2-1")[k]
        _box(ax, start, band[0], 1.0, band[1], f"all-reduce\nbucket {k}\n(layers {layers})", OP, size=7)
        _arrow(ax, (start, rows[0]), (start + 0.15, band[0] + band[1]), COMM)
        _arrow(ax, (start, rows[1] + 0.8), (start + 0.15, band[0]), COMM)
    done = x_b + 3.15
    _arrow(ax, (done, band[0] + band[1]), (done + 0.15, rows[0] + 0.1), "C2")
    _arrow(ax, (done, band[0]), (done + 0.15, rows[1] + 0.7), "C2")
    ax.text(done + 0.4, band[0] + band[1] / 2, "g = (g_0 + g_1) / 2, the average,\nnow on both ranks",
            ha="left", va="center", fontsize=8, color=COMM)  # fmt: skip
    ax.set_xlim(-1.0, done + 3.0)
    ax.set_ylim(-0.6, 4.2)
    ax.axis("off")
    ax.set_title(
        f"Data parallelism, one step on 2 ranks with {micro} micro-batches each: the same weights, other samples. "
        "The last micro-batch's backward\nfills gradient buckets, last layers first; each bucket's all-reduce "
        "averages it while backward goes on; both ranks then take the same step",
        fontsize=10,
    )
    return _save(fig, out_dir / "dp_step.png")


Slots = dict[tuple, int]
F_FACE, B_FACE = "#6baed6", "#fd8d3c"  # forward blue, backward orange (lighter: odd chunks)
F_LIGHT, B_LIGHT = "#c6dbef", "#fdd0a2"


def gpipe_slots(p: int, m: int) -> Slots:
    """GPipe with one unit of time per pass: (kind, micro-batch, stage) -> its slot. F_i runs on
    stage s at slot s + i; the last stage starts B_0 after its last forward, and B_i reaches stage s
    p - 1 - s slots later."""
    slots = {("F", i, s): s + i for s in range(p) for i in range(m)}
    slots.update({("B", i, s): (m + p - 1) + (p - 1 - s) + i for s in range(p) for i in range(m)})
    return slots


def _asap(orders: list[list[tuple]], needs) -> Slots:
    """Each rank runs its list in order, one slot per pass, each as soon as the passes ``needs(key)``
    names have finished: key -> the slot it runs in. Keys end with the rank."""
    done: Slots = {}
    nxt, free = [0] * len(orders), [0] * len(orders)
    while any(nxt[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while nxt[r] < len(order) and all(n in done for n in needs(order[nxt[r]])):
                key = order[nxt[r]]
                done[key] = max([free[r], *(done[n] + 1 for n in needs(key))])
                free[r], nxt[r], progressed = done[key] + 1, nxt[r] + 1, True
        if not progressed:
            raise ValueError("the orders deadlock")
    return done


def one_f_one_b_slots(p: int, m: int) -> Slots:
    """1F1B in Megatron-LM's order, one unit of time per pass: (kind, micro-batch, stage) -> its slot.
    Stage s runs min(p - s - 1, m) warm-up forwards, then one forward / one backward, then the
    cool-down backwards (``schedules.run_1f1b``), each pass as soon as its input is there."""
    orders = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        order = [("F", i, s) for i in range(warmup)]
        for j in range(m - warmup):
            order += [("F", warmup + j, s), ("B", j, s)]
        orders.append(order + [("B", i, s) for i in range(m - warmup, m)])

    def needs(key):
        kind, i, s = key
        if kind == "F":
            return [("F", i, s - 1)] if s else []
        return [("F", i, s)] + ([("B", i, s + 1)] if s < p - 1 else [])

    return _asap(orders, needs)


def interleaved_slots(p: int, m: int, v: int) -> Slots:
    """Interleaved 1F1B in Megatron-LM's order (``interleaved_order``: 2 (p - 1 - r) + (v - 1) p warm-up
    chunk-forwards on rank r), each pass of a chunk (L / (p v) layers) one slot, 1/v of a stage's
    pass: (kind, chunk, micro-batch, rank) -> its slot. Chunk c of rank r is virtual stage c p + r."""
    orders = [[(k, c, i, r) for step in interleaved_order(p, v, m, r) for k, c, i in step] for r in range(p)]

    def at(stage: int) -> tuple[int, int]:  # virtual stage -> (chunk, rank)
        return stage // p, stage % p

    def needs(key):
        kind, c, i, r = key
        s = c * p + r
        if kind == "F":
            return [("F", at(s - 1)[0], i, at(s - 1)[1])] if s else []
        return [("F", c, i, r)] + ([("B", at(s + 1)[0], i, at(s + 1)[1])] if s < p * v - 1 else [])

    return _asap(orders, needs)


def in_flight(slots: Slots, rank: int) -> int:
    """Most passes ``rank`` holds the activations of at once: forwarded, not yet backwarded."""
    alive = peak = 0
    for key in sorted((k for k in slots if k[-1] == rank), key=slots.get):
        alive += 1 if key[0] == "F" else -1
        peak = max(peak, alive)
    return peak


def _draw_schedule(ax, slots: Slots, p: int, v: int, span: float, title: str) -> None:
    """Stage 0 on top, one box per pass (a chunk's pass 1/v wide), idle slots hatched; at the right
    of each stage the most micro-batches whose activations it holds (a chunk's count 1/v)."""
    end = max(slots.values()) + 1
    busy = {(key[-1], t) for key, t in slots.items()}
    for key, t in slots.items():
        kind, s, chunk = key[0], key[-1], key[1] if len(key) == 4 else 0
        face = (
            (F_FACE if kind == "F" else B_FACE) if chunk % 2 == 0 else (F_LIGHT if kind == "F" else B_LIGHT)
        )
        label = f"{key[2]}" if len(key) == 4 else f"{kind}{key[1]}"  # interleaved: F/B and chunk by colour
        _box(ax, t / v + 0.05 / v, p - 1 - s + 0.1, 0.9 / v, 0.8, label, face, size=8)
    for s in range(p):
        for t in range(end):
            if (s, t) not in busy:
                ax.add_patch(plt.Rectangle((t / v + 0.05 / v, p - 1 - s + 0.1), 0.9 / v, 0.8, facecolor="#f0f0f0",
                                           edgecolor="#bbbbbb", hatch="///"))  # fmt: skip
        ax.text(-0.2, p - 1 - s + 0.5, f"stage {s}", ha="right", va="center", fontsize=9)
        held = in_flight(slots, s) / v
        ax.text(span + 0.2, p - 1 - s + 0.5, f"holds {held:g}", ha="left", va="center", fontsize=8)
    ax.set_xlim(-1.2, span + 1.6)
    ax.set_ylim(-1.0, p)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    unit = "one slot per forward (F, blue) or backward (B, orange)" + (
        " of one micro-batch"
        if v == 1
        else f" of one chunk of layers, 1/{v} of a stage's; lighter: odd chunks; the number: the micro-batch"
    )
    held = "holds: most micro-batches whose activations the stage keeps at once" + (
        "" if v == 1 else ", a chunk's 1/v"
    )
    ax.text(span / 2, -0.35, f"time: {unit};\nhatched: idle, the bubble; {held}", ha="center", va="top",
            fontsize=8)  # fmt: skip
    ax.set_title(title, fontsize=10)


def draw_gpipe(out_dir: Path, p: int = 4, m: int = 8) -> Path:
    """GPipe's schedule on ``p`` stages and ``m`` micro-batches, its idle slots marked."""
    end = 2 * (m + p - 1)
    fig, ax = plt.subplots(figsize=(11, 0.55 * p + 1.5))
    _draw_schedule(ax, gpipe_slots(p, m), p, 1, end, (
        f"GPipe, p = {p} stages, one step of m = {m} micro-batches: each stage idles {p - 1} x 2 of {end} slots,\n"
        f"(p - 1)/(m + p - 1) = {p - 1}/{m + p - 1} of the step; every stage holds all m micro-batches' activations"
    ))  # fmt: skip
    return _save(fig, out_dir / "gpipe.png")


def draw_one_f_one_b(out_dir: Path, p: int = 4, m: int = 8) -> Path:
    """1F1B on ``p`` stages and ``m`` micro-batches, drawn to GPipe's scale."""
    end = 2 * (m + p - 1)
    fig, ax = plt.subplots(figsize=(11, 0.55 * p + 1.5))
    _draw_schedule(ax, one_f_one_b_slots(p, m), p, 1, end, (
        f"1F1B, p = {p} stages, one step of m = {m} micro-batches: the bubble of GPipe, (p - 1)/(m + p - 1) = "
        f"{p - 1}/{m + p - 1} of the step\n(Narayanan et al. 2021: (p - 1)/m = {p - 1}/{m} of the ideal time 2m); "
        "stage s starts p - s - 1 forwards, then alternates, and holds at most p - s"
    ))  # fmt: skip
    return _save(fig, out_dir / "one_f_one_b.png")


def draw_interleaved(out_dir: Path, p: int = 4, m: int = 8, v: int = 2) -> Path:
    """Interleaved 1F1B on ``p`` ranks of ``v`` chunks and ``m`` micro-batches, drawn to GPipe's scale
    (one unit of time per stage pass, as there)."""
    end = 2 * (m + p - 1)
    fig, ax = plt.subplots(figsize=(11, 0.55 * p + 1.5))
    step = 2 * m + 2 * (p - 1) / v
    _draw_schedule(ax, interleaved_slots(p, m, v), p, v, end, (
        f"Interleaved 1F1B, p = {p} ranks x v = {v} chunks each, one step of m = {m} micro-batches: {step:g} units "
        f"instead of {end}.\nBubble (p - 1)/(v m + p - 1) = {p - 1}/{v * m + p - 1} of the step, or (1/v)(p - 1)/m = "
        f"{p - 1}/{v * m} of the ideal time 2m (Narayanan et al. 2021, 2.2.2);\nv p - 1 = {v * p - 1} sends per "
        f"micro-batch and direction, not p - 1 = {p - 1}"
    ))  # fmt: skip
    return _save(fig, out_dir / "interleaved_1f1b.png")


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
    print(draw_dp_step(out_dir))
    print(draw_tp_mlp(out_dir))
    print(draw_tp_block(out_dir))
    print(draw_gpipe(out_dir))
    print(draw_one_f_one_b(out_dir))
    print(draw_interleaved(out_dir))
    print(draw_placement(out_dir))


if __name__ == "__main__":
    main()
