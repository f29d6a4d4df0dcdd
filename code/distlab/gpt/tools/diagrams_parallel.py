"""Pictures of sharded model states, context parallelism and the five-dimension rank grid, drawn with
matplotlib into ``images/parallel/``.

Run from the repository root (the PNGs are committed; rerun after changing this file)::

    python -m distlab.gpt.tools.diagrams_parallel    # writes images/parallel/*.png

``zero_stages`` (notebook 07): ZeRO's Figure 1 (Rajbhandari et al. 2019, arXiv 1910.02054). Per rank,
mixed-precision Adam keeps 2 bytes of fp16 parameters, 2 of gradients and K = 12 of optimizer states
(fp32 master copy, two moments) per parameter: (2 + 2 + K) Psi bytes for Psi parameters. Stage 1
(P_os) shards the optimizer states over N_d data-parallel ranks, stage 2 (P_os+g) the gradients too,
stage 3 (P_os+g+p) the parameters too::

    baseline   2 Psi + 2 Psi + K Psi          P_os+g     2 Psi + (2 + K) Psi / N_d
    P_os       2 Psi + 2 Psi + K Psi / N_d    P_os+g+p   (2 + 2 + K) Psi / N_d

``distributed_optimizer`` (notebook 07, 11): Megatron's distributed optimizer as ZeRO-1, one gradient
bucket on d ranks: the gradients are reduce-scattered (averaged), rank r updates its shard r (fp32 main
parameters and Adam's moments), the updated parameters are all-gathered. With bf16 parameters and fp32
gradients: 2 + 4 + 12/d bytes per parameter per rank (Megatron-LM's table).

``ring_attention`` (notebook 09): cp ranks on a ring, each keeping its query chunk; at step s rank i
holds the K/V block of rank (i - s) mod cp and computes that one block of the attention matrix.

``causal_split`` (notebook 09): the 2 cp x 2 cp chunk pairs of causal attention, contiguous (rank i
holds chunks 2i, 2i+1) against balanced (chunks i and 2cp-1-i), from the engine's ``chunk_ids``.

``rank_grid`` (notebook 11): every rank's tp, cp, ep, dp and pp coordinate on two nodes, read from the
engine's :class:`~distlab.gpt.layout.Layout` (``coords`` and ``ep_groups``), with its groups and
whether each stays inside a node.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Circle, FancyArrowPatch, Polygon, Rectangle  # noqa: E402

from distlab import REPO_ROOT  # noqa: E402
from distlab.gpt.context_parallel.ring_attention import chunk_ids  # noqa: E402
from distlab.gpt.layout import Layout  # noqa: E402
from distlab.gpt.optimizer.distrib_optimizer import bytes_per_parameter  # noqa: E402
from distlab.gpt.tools.diagrams import COMM, _arrow, _save  # noqa: E402

STATES = ("parameters", "gradients", "optimizer states")
STATE_COLOURS = ("#6baed6", "#fd8d3c", "#74c476")
ZERO_STAGES = ("baseline (plain DP)", "ZeRO-1: P_os", "ZeRO-2: P_os+g", "ZeRO-3: P_os+g+p")
#: The five dimensions in Megatron's order (the first fastest); ep is cut out of cp x dp.
GRID_ORDER = ("tp", "cp", "ep", "dp", "pp")


# --- ZeRO ------------------------------------------------------------------------------------
def zero_bytes(stage: int, n: int, k: float = 12, p_bytes: float = 2, g_bytes: float = 2) -> tuple:
    """(parameters, gradients, optimizer states) bytes per parameter on each of ``n`` ranks at ZeRO
    ``stage`` (0 = plain data parallelism); ZeRO's mixed-precision Adam by default (2, 2, K = 12)."""
    return (
        p_bytes / (n if stage >= 3 else 1),
        g_bytes / (n if stage >= 2 else 1),
        k / (n if stage >= 1 else 1),
    )


def draw_zero_stages(out_dir: Path, n: int = 4, psi: float = 7.5e9, n_paper: int = 64, k: int = 12) -> Path:
    """ZeRO's stages on ``n`` drawn ranks; the memory per rank for Psi = 7.5 B, N_d = 64 (the paper's)."""
    full = 2 + 2 + k
    width, gap = 3.0, 0.35
    fig, ax = plt.subplots(figsize=(13, 4.6))
    for row, stage in enumerate(range(4)):
        y = 3 - row
        per_state = zero_bytes(stage, n, k)
        for r in range(n):
            x0 = r * (width + gap)
            start = 0.0
            for s, whole in enumerate((2, 2, k)):
                seg = width * whole / full
                sharded = per_state[s] < whole
                ax.add_patch(Rectangle((x0 + start, y + 0.2), seg, 0.5, facecolor="white" if sharded else
                                       STATE_COLOURS[s], edgecolor="#888888", hatch="///" if sharded else None))  # fmt: skip
                if sharded:  # rank r keeps shard r of the state
                    ax.add_patch(Rectangle((x0 + start + r * seg / n, y + 0.2), seg / n, 0.5,
                                           facecolor=STATE_COLOURS[s], edgecolor="black"))  # fmt: skip
                start += seg
            if row == 0:
                ax.text(x0 + width / 2, 4.0, f"rank {r}", ha="center", fontsize=9)
        ax.text(-0.2, y + 0.45, ZERO_STAGES[stage], ha="right", va="center", fontsize=9)
        total = sum(zero_bytes(stage, n_paper, k))
        formula = ("2Ψ + 2Ψ + KΨ", "2Ψ + 2Ψ + KΨ/N_d", "2Ψ + (2 + K)Ψ/N_d", "(2 + 2 + K)Ψ/N_d")[stage]
        ax.text(n * (width + gap) + 0.1, y + 0.45, f"{formula} = {total * psi / 1e9:.1f} GB",
                ha="left", va="center", fontsize=9)  # fmt: skip
    for s, name in enumerate(STATES):
        ax.add_patch(Rectangle((s * 2.6, -0.35), 0.3, 0.25, facecolor=STATE_COLOURS[s], edgecolor="black"))
        ax.text(s * 2.6 + 0.4, -0.22, name, va="center", fontsize=8)
    ax.add_patch(Rectangle((3 * 2.6, -0.35), 0.3, 0.25, facecolor="white", edgecolor="#888888", hatch="///"))
    ax.text(3 * 2.6 + 0.4, -0.22, "held by another rank", va="center", fontsize=8)
    ax.set_xlim(-2.6, n * (width + gap) + 3.6)
    ax.set_ylim(-0.5, 4.3)
    ax.axis("off")
    ax.set_title(
        f"ZeRO's stages on N_d = {n} ranks (drawn), mixed-precision Adam: 2 + 2 + K bytes per parameter, "
        f"K = {k}.\nRight: per rank for Ψ = {psi / 1e9:g} B parameters on N_d = {n_paper} "
        "(Rajbhandari et al. 2019, Figure 1)",
        fontsize=10,
    )
    return _save(fig, out_dir / "zero_stages.png")


def draw_distributed_optimizer(out_dir: Path, d: int = 4) -> Path:
    """One bucket on ``d`` ranks: reduce-scatter the gradients, Adam on the own shard, all-gather."""
    fig, ax = plt.subplots(figsize=(13, 0.75 * d + 1.8))
    cell, cols = 0.55, (0.0, 4.4, 10.0)
    titles = (
        "1. after backward: each rank's\nwhole gradient buffer (its own tokens)",
        "2. reduce-scatter (average over d):\nrank r keeps shard r; Adam updates it",
        "3. all-gather: every rank has\nevery updated parameter shard",
    )
    for c, (x0, title) in enumerate(zip(cols, titles, strict=True)):
        ax.text(x0 + d * cell / 2, d + 0.25, title, ha="center", va="bottom", fontsize=9)
        for r in range(d):
            y = d - 1 - r
            if c == 0:
                ax.text(x0 - 0.15, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=9)
            for j in range(d):
                if c == 0:
                    face, text = "#d9d9d9", "g"
                elif c == 1:
                    face, text = (f"C{j}", f"g{j}") if j == r else ("#f0f0f0", "")  # kept, not used
                else:
                    face, text = f"C{j}", f"w{j}"
                ax.add_patch(Rectangle((x0 + j * cell, y + 0.15), cell, 0.5, facecolor=face, edgecolor="black",
                                       alpha=0.6 if face.startswith("C") else 1.0))  # fmt: skip
                ax.text(x0 + j * cell + cell / 2, y + 0.4, text, ha="center", va="center", fontsize=8)
            if c == 1:
                ax.text(x0 + d * cell + 0.15, y + 0.4, f"fp32 w{r}, m{r}, v{r}", va="center", fontsize=8,
                        color=f"C{r}")  # fmt: skip
        if c < 2:
            a, b = x0 + d * cell + (2.0 if c == 1 else 0.3), cols[c + 1] - 0.3
            _arrow(ax, (a, d / 2), (b, d / 2), COMM)
            ax.text((a + b) / 2, d / 2 + 0.1, ("reduce-scatter", "all-gather")[c], ha="center", fontsize=8,
                    color=COMM)  # fmt: skip
    ax.set_xlim(-1.0, cols[2] + d * cell + 0.5)
    ax.set_ylim(-0.6, d + 1.1)
    ax.axis("off")
    bf16 = bytes_per_parameter(torch.bfloat16, d)
    ax.text((cols[2] + d * cell) / 2, -0.45,
            f"bf16 parameters (2) and the fp32 gradient buffer (4) stay whole; fp32 main parameters and Adam's "
            f"moments (12) are split: 6 + 12/d = {bf16:g} bytes per parameter per rank at d = {d}, 18 without",
            ha="center", fontsize=8)  # fmt: skip
    ax.set_title(f"Megatron's distributed optimizer = ZeRO-1, one gradient bucket on d = {d} data-parallel ranks",
                 fontsize=10)  # fmt: skip
    return _save(fig, out_dir / "distributed_optimizer.png")


# --- context parallelism -----------------------------------------------------------------------
def ring_schedule(cp: int) -> list[list[int]]:
    """``[step][rank]``: whose K/V block rank i holds at step s, (i - s) mod cp (the engine's ring)."""
    return [[(i - s) % cp for i in range(cp)] for s in range(cp)]


def draw_ring_attention(out_dir: Path, cp: int = 4) -> Path:
    """The ring of ``cp`` ranks and, per step, the block of the attention matrix each rank computes."""
    steps = ring_schedule(cp)
    fig, axes = plt.subplots(
        1, cp + 1, figsize=(3.0 * (cp + 1), 3.4), gridspec_kw={"width_ratios": [1.3] + [1] * cp}
    )
    ax = axes[0]
    centres = [(math.sin(2 * math.pi * i / cp), math.cos(2 * math.pi * i / cp)) for i in range(cp)]
    for i, (x, y) in enumerate(centres):
        ax.add_patch(
            Circle((x, y), 0.3, facecolor=matplotlib.colors.to_hex(f"C{i}") + "66", edgecolor="black")
        )
        ax.text(x, y, f"rank {i}\nQ{i}", ha="center", va="center", fontsize=8)
        (x2, y2) = centres[(i + 1) % cp]
        ax.add_patch(FancyArrowPatch((x, y), (x2, y2), arrowstyle="-|>", mutation_scale=12, color=COMM,
                                     shrinkA=22, shrinkB=22, connectionstyle="arc3,rad=-0.2"))  # fmt: skip
    ax.text(0, 0, "K/V blocks\ntravel\ni -> i+1", ha="center", va="center", fontsize=8, color=COMM)
    ax.set_xlim(-1.5, 1.5)
    ax.set_ylim(-1.5, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("queries stay, K/V travel", fontsize=9)
    for s, ax in enumerate(axes[1:]):
        for i in range(cp):
            for j in range(cp):
                held = steps[s][i] == j
                done = any(steps[t][i] == j for t in range(s))
                face = f"C{i}" if held else ("#d9d9d9" if done else "white")
                ax.add_patch(Rectangle((j, cp - 1 - i), 1, 1, facecolor=face, edgecolor="#888888",
                                       alpha=0.7 if held else 1.0))  # fmt: skip
                if held:
                    ax.text(j + 0.5, cp - 0.5 - i, f"Q{i}\nKV{j}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, cp)
        ax.set_ylim(0, cp)
        ax.set_aspect("equal")
        ax.set_xticks([j + 0.5 for j in range(cp)], [f"KV{j}" for j in range(cp)], fontsize=7)
        ax.set_yticks([cp - 0.5 - i for i in range(cp)], [f"Q{i}" for i in range(cp)], fontsize=7)
        ax.set_title(f"step {s}" + (": own block" if s == 0 else f": block of rank i-{s}"), fontsize=9)
    fig.suptitle(f"Ring attention on cp = {cp} ranks: each step, each rank computes one block of the attention "
                 "matrix (grey: done) while the K/V block moves on", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return _save(fig, out_dir / "ring_attention.png")


def causal_pairs(cp: int, balanced: bool = True) -> dict[int, list[tuple[int, int]]]:
    """Per cp rank, the (query chunk, key chunk) pairs of its causal attention that are not fully
    masked (key chunk <= query chunk), for the chunks the engine's ``chunk_ids`` gives it."""
    return {
        i: [(a, b) for a in chunk_ids(cp, i, balanced) for b in range(2 * cp) if b <= a] for i in range(cp)
    }


def draw_causal_split(out_dir: Path, cp: int = 4) -> Path:
    """Causal attention's 2cp x 2cp chunk pairs coloured by the rank that computes them, both splits."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
    n = 2 * cp
    for ax, balanced in zip(axes, (False, True), strict=True):
        pairs = causal_pairs(cp, balanced)
        owner = {a: i for i, chunks in ((i, chunk_ids(cp, i, balanced)) for i in range(cp)) for a in chunks}
        for a in range(n):
            y = n - 1 - a
            for b in range(n):
                face = matplotlib.colors.to_hex(f"C{owner[a]}") + "99"
                if b < a:
                    ax.add_patch(Rectangle((b, y), 1, 1, facecolor=face, edgecolor="white"))
                elif b == a:  # the causal triangle inside the diagonal pair
                    ax.add_patch(Polygon([(b, y + 1), (b, y), (b + 1, y)], facecolor=face, edgecolor="white"))
                    ax.add_patch(Rectangle((b, y), 1, 1, facecolor="none", edgecolor="#cccccc"))
                else:
                    ax.add_patch(Rectangle((b, y), 1, 1, facecolor="white", edgecolor="#eeeeee"))
            ax.text(-0.2, y + 0.5, f"chunk {a}: rank {owner[a]}", ha="right", va="center", fontsize=8,
                    color=f"C{owner[a]}")  # fmt: skip
        counts = ", ".join(str(len(pairs[i])) for i in range(cp))
        how = "balanced: rank i holds chunks i, 2cp-1-i" if balanced else "contiguous: rank i holds 2i, 2i+1"
        ax.set_title(f"{how}\nchunk pairs computed by ranks 0..{cp - 1}: {counts}", fontsize=9)
        ax.set_xlim(-3.2, n)
        ax.set_ylim(-0.8, n)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.text(n / 2, -0.5, "key chunk 0 .. 2cp-1 (white: masked, skipped)", ha="center", fontsize=8)
    fig.suptitle(
        f"Causal attention over 2cp = {n} chunks on cp = {cp} ranks (rows: query chunks)", fontsize=10
    )
    fig.tight_layout()
    return _save(fig, out_dir / "causal_split.png")


# --- the rank grid -------------------------------------------------------------------------------
def grid_groups(layout: Layout, dim: str) -> list[list[int]]:
    """The groups of ``dim`` as the engine builds them (ep: ``ep_groups``, the others ``groups``)."""
    return layout.ep_groups() if dim == "ep" else layout.groups(dim)


def rank_grid(layout: Layout) -> dict[int, dict[str, int]]:
    """Every rank's coordinate per dimension of :data:`GRID_ORDER`: the engine's ``Layout.coords``,
    and for ep its place in its ``ep_groups`` block."""
    ep_rank = {r: g.index(r) for g in layout.ep_groups() for r in g}
    grid = {}
    for rank in range(layout.world_size):
        coords = dict(zip(("tp", "cp", "dp", "pp"), layout.coords(rank), strict=True))
        grid[rank] = {dim: ep_rank[rank] if dim == "ep" else coords[dim] for dim in GRID_ORDER}
    return grid


def inside_node(groups: list[list[int]], per_node: int) -> bool:
    """Whether every group's ranks share a node (nodes of ``per_node`` consecutive ranks)."""
    return all(len({r // per_node for r in g}) == 1 for g in groups)


def draw_rank_grid(out_dir: Path, nodes: int = 2, per_node: int = 8, tp: int = 2, cp: int = 2, pp: int = 2,
                   ep: int = 2) -> Path:  # fmt: skip
    """Ranks of tp x cp x dp x pp (ep over dp x cp) on ``nodes`` x ``per_node`` devices, Megatron's order."""
    layout = Layout(nodes * per_node, tp=tp, cp=cp, pp=pp, ep=ep)
    grid, world = rank_grid(layout), layout.world_size
    pastel = plt.get_cmap("Pastel1").colors + plt.get_cmap("Pastel2").colors
    fig, ax = plt.subplots(figsize=(0.62 * world + 4.5, 4.2))
    for r in range(world):
        node = r // per_node
        ax.add_patch(
            Rectangle((r, len(GRID_ORDER)), 1, 0.8, facecolor=f"C{node}", edgecolor="white", alpha=0.8)
        )
        ax.text(r + 0.5, len(GRID_ORDER) + 0.4, str(r), ha="center", va="center", fontsize=9, color="white",
                weight="bold")  # fmt: skip
    for n in range(nodes):
        ax.text(n * per_node + per_node / 2, len(GRID_ORDER) + 1.05, f"node {n}: ranks {n * per_node}-"
                f"{(n + 1) * per_node - 1}", ha="center", fontsize=10, color=f"C{n}", weight="bold")  # fmt: skip
    for row, dim in enumerate(GRID_ORDER):
        y = len(GRID_ORDER) - 1 - row
        groups = grid_groups(layout, dim)
        group_of = {r: g for g, members in enumerate(groups) for r in members}
        for r in range(world):
            ax.add_patch(
                Rectangle((r, y), 1, 1, facecolor=pastel[group_of[r] % len(pastel)], edgecolor="white")
            )
            ax.text(r + 0.5, y + 0.5, str(grid[r][dim]), ha="center", va="center", fontsize=9)
        size = layout.size(dim)
        ax.text(-0.2, y + 0.5, f"{dim} = {size}", ha="right", va="center", fontsize=10)
        inside = inside_node(groups, per_node)
        where = "inside a node" if inside else "across nodes"
        ax.text(world + 0.2, y + 0.5, f"{len(groups)} groups of {len(groups[0])}: {where}", ha="left",
                va="center", fontsize=9, color="C2" if inside else COMM)  # fmt: skip
    for n in range(1, nodes):
        ax.plot([n * per_node] * 2, [-0.1, len(GRID_ORDER) + 0.8], color="black", lw=2.5)
    ax.text(world / 2, -0.45, "each cell: the rank's coordinate in that dimension; one colour per group "
            "(ranks that differ only in that coordinate)", ha="center", fontsize=8)  # fmt: skip
    ax.set_xlim(-1.5, world + 4.2)
    ax.set_ylim(-0.7, len(GRID_ORDER) + 1.4)
    ax.axis("off")
    ax.set_title(
        f"world {world} = tp {tp} x cp {cp} x dp {layout.dp} x pp {pp}, ep {ep} cut from dp x cp, on {nodes} "
        f"nodes x {per_node} GPUs; Megatron's order tp-cp-ep-dp-pp (first fastest):\n"
        "rank = ((pp_rank x dp + dp_rank) x cp + cp_rank) x tp + tp_rank",
        fontsize=10,
    )
    return _save(fig, out_dir / "rank_grid.png")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = Path(argv[0]) if argv else REPO_ROOT / "images" / "parallel"
    for draw in (draw_zero_stages, draw_distributed_optimizer, draw_ring_attention, draw_causal_split,
                 draw_rank_grid):  # fmt: skip
        print(draw(out_dir))


if __name__ == "__main__":
    main()
