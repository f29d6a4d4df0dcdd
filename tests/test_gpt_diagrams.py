"""The pictures draw and the committed PNGs are there. GPipe's slots leave (p - 1)/(m + p - 1) of every
stage idle; 1F1B's (Megatron's order) run every pass once, after what it needs, with p - s - 1 warm-up
forwards on stage s, at most p - s micro-batches alive and GPipe's bubble; interleaved 1F1B's (v chunks
per rank, passes 1/v long) leave (p - 1)/(v m + p - 1) of the step idle, (1/v)(p - 1)/m of the ideal
time (Narayanan et al. 2021, section 2.2.2)."""

from __future__ import annotations

import pytest

from distlab import REPO_ROOT
from distlab.gpt.memory.memory_estimate import MemorySetup, chunks_in_flight
from distlab.gpt.tools import diagrams

pytestmark = pytest.mark.engine_fast


def test_diagrams_draw_and_are_committed(tmp_path):
    drawn = [
        diagrams.draw_dp_step(tmp_path),
        diagrams.draw_tp_mlp(tmp_path),
        diagrams.draw_tp_block(tmp_path),
        diagrams.draw_gpipe(tmp_path),
        diagrams.draw_one_f_one_b(tmp_path),
        diagrams.draw_interleaved(tmp_path),
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


@pytest.mark.parametrize("p, m", [(2, 1), (4, 2), (4, 4), (4, 8), (3, 5), (8, 16)])
def test_one_f_one_b_picture(p, m):
    slots = diagrams.one_f_one_b_slots(p, m)
    assert set(slots) == {(k, i, s) for k in "FB" for i in range(m) for s in range(p)}  # each pass once
    end = max(slots.values()) + 1
    assert end == 2 * (m + p - 1)  # GPipe's step: the same bubble, (p - 1)/(m + p - 1)
    for s in range(p):
        order = sorted((key for key in slots if key[2] == s), key=slots.get)
        assert len({slots[key] for key in order}) == 2 * m  # one pass at a time
        assert 1 - 2 * m / end == pytest.approx((p - 1) / (m + p - 1))
        first_backward = [k for k, _, _ in order].index("B")
        assert first_backward == min(p - s - 1, m) + (m > p - s - 1)  # warm-up p - s - 1, then F before B
        assert diagrams.in_flight(slots, s) == min(p - s, m)  # at most p micro-batches on stage 0
    for (kind, i, s), t in slots.items():  # every pass after what it needs
        if kind == "F" and s > 0:
            assert t > slots["F", i, s - 1]
        if kind == "B":
            assert t > slots["F", i, s] and (s == p - 1 or t > slots["B", i, s + 1])


@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (3, 6, 2)])
def test_interleaved_picture(p, m, v):
    slots = diagrams.interleaved_slots(p, m, v)  # slots of 1/v of a stage's pass
    keys = {(k, c, i, r) for k in "FB" for c in range(v) for i in range(m) for r in range(p)}
    assert set(slots) == keys  # each rank runs each chunk's F and B of each micro-batch once
    end = max(slots.values()) + 1
    ideal = 2 * v * m  # busy slots per rank: 2m stage passes
    assert end == ideal + 2 * (p - 1)  # the pipeline fills and drains in chunk slots
    assert (end - ideal) / ideal == pytest.approx((p - 1) / (v * m))  # Narayanan et al. 2021, 2.2.2
    assert 1 - ideal / end == pytest.approx((p - 1) / (v * m + p - 1))  # the share of the step
    for r in range(p):
        assert len({t for key, t in slots.items() if key[3] == r}) == ideal  # one pass at a time
    for (kind, c, i, r), t in slots.items():  # every pass after what it needs
        s = c * p + r  # virtual stage
        if kind == "F" and s > 0:
            assert t > slots["F", (s - 1) // p, i, (s - 1) % p]
        if kind == "B":
            assert t > slots["F", c, i, r]
            assert s == p * v - 1 or t > slots["B", (s + 1) // p, i, (s + 1) % p]
    setup = MemorySetup(4 * p * v, 64, 4, 64, 128, 1, pp=p, vp=v, num_micro_batches=m)
    assert diagrams.in_flight(slots, 0) == chunks_in_flight(setup)  # the memory estimate's count
