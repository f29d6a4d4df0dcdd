"""The ZeRO, distributed-optimizer, ring-attention, causal-split and rank-grid pictures draw and are
committed; what they encode holds: ZeRO's Figure 1 numbers, Megatron's 6 + 12/d, a ring that shows every
rank every block once, a balanced split with equal causal work per rank, and the engine's rank mapping."""

from __future__ import annotations

import pytest
import torch

from distlab import REPO_ROOT
from distlab.gpt.context_parallel.ring_attention import pair_work
from distlab.gpt.layout import Layout, describe_groups
from distlab.gpt.optimizer.distrib_optimizer import bytes_per_parameter
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tools import diagrams_parallel as dp

pytestmark = pytest.mark.engine_fast


def test_pictures_draw_and_are_committed(tmp_path):
    drawn = [
        dp.draw_zero_stages(tmp_path),
        dp.draw_distributed_optimizer(tmp_path),
        dp.draw_ring_attention(tmp_path),
        dp.draw_causal_split(tmp_path),
        dp.draw_rank_grid(tmp_path),
    ]
    assert all(p.stat().st_size > 10_000 for p in drawn)
    committed = {p.name for p in (REPO_ROOT / "images" / "parallel").glob("*.png")}
    assert committed == {p.name for p in drawn}  # what the notebooks show is committed


def test_zero_stages_give_the_papers_figure_1():
    psi, n = 7.5e9, 64  # Rajbhandari et al., Figure 1: 120, 31.4, 16.6 and 1.9 GB per rank
    totals = [sum(dp.zero_bytes(stage, n)) * psi / 1e9 for stage in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    for stage in range(4):  # fp32 Adam (4 + 4 + 8), as notebook 07 writes it: 16, 8 + 8/N, 4 + 12/N, 16/N
        assert sum(dp.zero_bytes(stage, 4, k=8, p_bytes=4, g_bytes=4)) == [16, 10, 7, 4][stage]


@pytest.mark.parametrize("d", [1, 2, 4, 64])
def test_distributed_optimizer_is_zero_1_with_a_whole_gradient_buffer(d):
    params, _, optimizer = dp.zero_bytes(1, d, k=12, p_bytes=2, g_bytes=4)  # bf16 params, fp32 gradients
    assert params + 4 + optimizer == pytest.approx(bytes_per_parameter(torch.bfloat16, d))


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_ring_shows_every_rank_every_block_once(cp):
    steps = dp.ring_schedule(cp)
    for i in range(cp):
        assert sorted(step[i] for step in steps) == list(range(cp))  # every block once per rank
    for s in range(cp):
        assert sorted(steps[s]) == list(range(cp))  # each block on one rank at a time
        if s:  # what rank i holds now, rank i - 1 held one step before: passed along the ring
            assert all(steps[s][i] == steps[s - 1][(i - 1) % cp] for i in range(cp))


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_balanced_split_gives_every_rank_the_same_causal_work(cp):
    balanced, contiguous = dp.causal_pairs(cp, True), dp.causal_pairs(cp, False)
    assert {len(p) for p in balanced.values()} == {2 * cp + 1}  # the same unmasked pairs on every rank
    assert [len(contiguous[i]) for i in range(cp)] == [4 * i + 3 for i in range(cp)]
    for pairs in (balanced, contiguous):  # together they are the causal triangle, each pair once
        every = sorted(p for ps in pairs.values() for p in ps)
        assert every == [(a, b) for a in range(2 * cp) for b in range(a + 1)]
    for split, flag in ((balanced, True), (contiguous, False)):  # the engine's count: a diagonal pair is 1/2
        work = [sum(row) for row in pair_work(cp, flag)]
        assert work == [sum(0.5 if a == b else 1.0 for a, b in split[i]) for i in range(cp)]


@pytest.mark.parametrize("sizes", [dict(tp=2, cp=2, pp=2, ep=2), dict(tp=2, cp=1, pp=1, ep=4),
                                   dict(tp=1, cp=2, pp=2, ep=1), dict(tp=4, cp=2, pp=1, ep=2)])  # fmt: skip
def test_rank_grid_is_the_engines_mapping(sizes):
    layout = Layout(16, **sizes)
    grid = dp.rank_grid(layout)
    for rank, c in grid.items():
        state = ParallelState(layout=layout, rank=rank)  # the engine's coordinates of this rank
        assert (c["tp"], c["cp"], c["dp"], c["pp"], c["ep"]) == (
            state.tp_rank,
            state.cp_rank,
            state.dp_rank,
            state.pp_rank,
            state.ep_rank,
        )
        # Megatron's order tp-cp-dp-pp, ep cut from cp x dp (its expert grid, etp = tp: tp-ep-edp-pp)
        assert rank == ((c["pp"] * layout.dp + c["dp"]) * layout.cp + c["cp"]) * layout.tp + c["tp"]
        assert c["ep"] == (c["cp"] + layout.cp * c["dp"]) % layout.ep
    per_node = 8
    lines = {line.split()[0]: line for line in describe_groups(layout, per_node)}
    for dim in ("tp", "cp", "dp", "pp"):  # inside / across a node as the engine's own description says
        if layout.size(dim) > 1:
            inside = dp.inside_node(dp.grid_groups(layout, dim), per_node)
            assert lines[dim].endswith("inside a node") == inside
