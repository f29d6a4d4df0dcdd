"""The TP block and TP=2 x PP=2 placement pictures draw, and the committed PNGs are there."""

from __future__ import annotations

import pytest

from distlab import REPO_ROOT
from distlab.gpt.tools import diagrams

pytestmark = pytest.mark.engine_fast


def test_diagrams_draw_and_are_committed(tmp_path):
    drawn = [diagrams.draw_tp_block(tmp_path), diagrams.draw_placement(tmp_path)]
    assert all(p.stat().st_size > 10_000 for p in drawn)
    committed = {p.name for p in (REPO_ROOT / "images" / "gpt").glob("*.png")}
    assert committed == {p.name for p in drawn}  # what the notebooks show is committed
