"""The TP MLP and block, GPipe's schedule and the TP=2 x PP=2 placement pictures draw, and the committed
PNGs are there; GPipe's slots leave (p - 1)/(m + p - 1) of every stage idle."""

from __future__ import annotations

import pytest

from distlab import REPO_ROOT
from distlab.gpt.tools import diagrams

pytestmark = pytest.mark.engine_fast


def test_diagrams_draw_and_are_committed(tmp_path):
    drawn = [
        diagrams.draw_tp_mlp(tmp_path),
        diagrams.draw_tp_block(tmp_path),
        diagrams.draw_gpipe(tmp_path),
        diagrams.draw_placement(tmp_path),
    ]
    assert all(p.stat().st_size > 10_000 for p in drawn)
    committed = {p.name for p in (REPO_ROOT / "images" / "gpt").glob("*.png")}
    assert committed == {p.name for p in drawn}  # what the notebooks show is committed


@pytest.mark.parametrize("p, m", [(2, 1), (4, 4), (4, 8)])
def test_gpipe_picture_leaves_the_bubble(p, m):
    slots = diagrams.gpipe_slots(p, m)
    end = 2 * (m + p - 1)
    for s in range(p):
        used = sorted(t for (_, _, stage), t in slots.items() if stage == s)
        assert len(set(used)) == 2 * m and used[-1] < end  # one pass per slot, inside the step
        assert 1 - len(used) / end == pytest.approx((p - 1) / (m + p - 1))
    for (kind, i, s), t in slots.items():  # every pass after what it needs
        if kind == "F" and s > 0:
            assert t > slots["F", i, s - 1]
        if kind == "B":
            assert t > slots["F", i, s] and (s == p - 1 or t > slots["B", i, s + 1])
