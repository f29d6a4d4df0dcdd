"""What a pipeline timeline (``--pipeline-timeline``) says regardless of speed: the order.

On a shared CPU the durations of forward (F) and backward (B) passes are distorted (ranks take
turns on the cores), but the order in which each stage runs them is the schedule's own:

    GPipe   stage s: F0 F1 ... F(m-1) B0 B1 ... B(m-1)          m micro-batches alive at once
    1F1B    stage s: (p - s) warm-up forwards, then F/B alternate   at most p - s alive
    interleaved (v chunks): F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 ...      chunk.micro-batch
"""

from __future__ import annotations

from distlab.gpt.pipeline_parallel.timeline import event_label


def _stage_events(timeline: dict, stage: int) -> list[dict]:
    return sorted((e for e in timeline["events"] if e["stage"] == stage), key=lambda e: e["start"])


def schedule_order(timeline: dict, stage: int) -> list[str]:
    """``["F0", "F1", "B0", ...]`` (interleaved: ``"F0.1"``, chunk 0 of micro-batch 1): the passes
    of ``stage`` in the order they started."""
    return [event_label(e, timeline.get("chunks", 1)) for e in _stage_events(timeline, stage)]


def max_in_flight(timeline: dict, stage: int) -> int:
    """Most micro-batches (interleaved: chunk-forwards) whose activations ``stage`` held at once
    (forwarded, not yet backwarded)."""
    alive = peak = 0
    for e in _stage_events(timeline, stage):
        alive += 1 if e["kind"] == "F" else -1
        peak = max(peak, alive)
    return peak
