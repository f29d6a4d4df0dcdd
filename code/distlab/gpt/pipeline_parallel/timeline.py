"""When each stage ran each micro-batch's forward and backward: record, gather, save, measure.

The plot is in ``plot.py``.

The bubble of a pipeline step is the time stages sit idle. With ``p`` stages, ``m``
micro-batches and every forward taking ``t_f``, every backward ``t_b``, a step lasts
``(m + p - 1)(t_f + t_b)`` of which each stage computes ``m (t_f + t_b)``, so

    bubble = 1 - m / (m + p - 1) = (p - 1) / (m + p - 1)      (GPipe and 1F1B alike)

Interleaved 1F1B with ``v`` chunks per rank: each F and B is ``1/v`` as long and the fill and
drain take ``p - 1`` of those shorter slots, so a step lasts ``(v m + p - 1)(t_f + t_b) / v``:

    bubble = (p - 1) / (v m + p - 1),   bubble / busy time = (p - 1) / (v m)   (v = 1: 1F1B's)

The measured bubble is ``1 - sum of busy time / (p x step span)``, the span running from the
first forward start to the last backward end over all stages. It is larger than the theory
when stages are unequal (the last stage also computes the logits and the loss) or when
communication is slow, which is what the plot lets you see.

Clocks: each rank times itself with ``time.perf_counter`` from a barrier over its pipeline
group at the start of the step, so ranks on different nodes share a zero up to the barrier's
skew (well under a millisecond locally).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

Event = dict  # {"stage": int, "kind": "F" | "B", "mb": int, "chunk": int, "start": float, "end": float}


def event_label(event: Event, chunks: int = 1) -> str:
    """``F3`` (forward of micro-batch 3), or with interleaving ``F1.3`` (through chunk 1)."""
    if chunks > 1:
        return f"{event['kind']}{event['chunk']}.{event['mb']}"
    return f"{event['kind']}{event['mb']}"


def theoretical_bubble(p: int, m: int, v: int = 1) -> float:
    """(p - 1) / (v m + p - 1): idle fraction of an ideal pipeline step (v chunks per rank)."""
    return (p - 1) / (v * m + p - 1)


def measured_bubble(events: Sequence[Event], p: int) -> float:
    """1 - busy / (p x span) over the recorded events of one step."""
    if not events:
        raise ValueError("no timeline events recorded: was --pipeline-timeline set on a pipelined run?")
    span = max(e["end"] for e in events) - min(e["start"] for e in events)
    busy = sum(e["end"] - e["start"] for e in events)
    return 1.0 - busy / (p * span) if span > 0 else 0.0


class PipelineTimeline:
    """Per-rank recorder of forward (F) and backward (B) spans of the current step."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.stage, self.num_stages, self.device, self.group = stage, num_stages, device, group
        self.events: list[Event] = []
        self.schedule, self.num_microbatches, self.chunks, self._t0 = "", 0, 1, 0.0

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels are asynchronous: time their end

    def start_step(self, schedule: str, num_microbatches: int, chunks: int = 1) -> None:
        """Forget the previous step; align the clock with the other stages."""
        self._sync()
        if self.group is not None and dist.is_initialized():
            dist.barrier(group=self.group)
        self.events, self.schedule, self.num_microbatches = [], schedule, num_microbatches
        self.chunks = chunks
        self._t0 = time.perf_counter()

    @contextmanager
    def record(self, kind: str, microbatch: int, chunk: int = 0) -> Iterator[None]:
        """Time the block as ``kind`` ("F" or "B") of ``microbatch`` through model ``chunk``."""
        self._sync()
        start = time.perf_counter() - self._t0
        yield
        self._sync()
        self.events.append(
            {
                "stage": self.stage,
                "kind": kind,
                "mb": microbatch,
                "chunk": chunk,
                "start": start,
                "end": time.perf_counter() - self._t0,
            }
        )

    def gather(self) -> dict:
        """Every stage's events of this step (collective over ``group``), as one JSON-able dict."""
        events = list(self.events)
        if self.group is not None and dist.is_initialized():
            parts: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(parts, events, group=self.group)
            events = [e for part in parts for e in part]
        p, m, v = self.num_stages, self.num_microbatches, self.chunks
        return {
            "schedule": self.schedule if v == 1 else f"interleaved {self.schedule}",
            "stages": p,
            "microbatches": m,
            "chunks": v,
            "events": events,
            "measured_bubble": measured_bubble(events, p),
            "theoretical_bubble": theoretical_bubble(p, m, v),
        }


def save_timeline(timeline: dict, path: str | Path) -> Path:
    """Write a gathered timeline as JSON (creating its folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(timeline, indent=1))
    return path


def load_timeline(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def bubble_summary(timeline: dict) -> str:
    """One line: schedule, p, (v,) m, measured vs theoretical bubble."""
    v = timeline.get("chunks", 1)
    chunks, vm = (f" v={v}", "vm") if v > 1 else ("", "m")
    return (
        f"{timeline['schedule']}: p={timeline['stages']}{chunks} m={timeline['microbatches']} "
        f"bubble measured {timeline['measured_bubble']:.1%} vs theoretical (p-1)/({vm}+p-1) = "
        f"{timeline['theoretical_bubble']:.1%}"
    )
