"""Schedule order and live micro-batches read from a pipeline timeline."""

from __future__ import annotations

from distlab.logs.pipeline import max_in_flight, schedule_order


def _timeline(order_by_stage: dict[int, str]) -> dict:
    events = []
    for stage, order in order_by_stage.items():
        for t, item in enumerate(order.split()):
            events.append(
                {"stage": stage, "kind": item[0], "mb": int(item[1:]), "start": float(t), "end": t + 0.5}
            )
    return {"events": events[::-1]}  # stored order must not matter


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p_minus_s():
    gpipe = _timeline({0: "F0 F1 F2 F3 B0 B1 B2 B3", 1: "F0 F1 F2 F3 B0 B1 B2 B3"})
    one_f_one_b = _timeline({0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 B0 F1 B1 F2 B2 F3 B3"})
    assert schedule_order(one_f_one_b, 0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert [max_in_flight(gpipe, s) for s in (0, 1)] == [4, 4]
    assert [max_in_flight(one_f_one_b, s) for s in (0, 1)] == [2, 1]
