"""All-reduces per training step, counted in a PyTorch profiler trace (``--profile-execution``).

Every ``torch.distributed.all_reduce`` appears in the trace as a ``c10d::allreduce_`` operator
with the shape of its tensor (``record_shapes=True``). Within the ``ProfilerStep#k`` spans they
are grouped by shape, which names their origin in a tensor-parallel GPT (b micro batch, s
sequence, h hidden, m micro-batches per step, L layers per stage):

    (b, s, h)   the block's g (forward, after attention and after the MLP) and f (backward,
                before both): 4 per layer per micro-batch = 4 L m; plus the vocab-parallel
                embedding's forward and the logits' f in backward: 2 m
    (b, s)      the vocab-parallel cross-entropy (max, sum of exponentials, target logit)
    ()          the gradient norm and the loss

Expert parallelism's ``all_to_all_single`` calls appear as ``c10d::alltoall_base_``
(:func:`ops_per_step` with :data:`ALLTOALL`): per MoE layer and micro-batch, forward sends the
counts (E,), dispatches and combines the tokens (uneven, (rows, h)); backward repeats the last two.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

ALLREDUCE = "c10d::allreduce_"
ALLTOALL = "c10d::alltoall_base_"


def load_trace(path_or_dir: str | Path) -> dict:
    """A ``*.pt.trace.json`` file, or the newest one under a folder."""
    p = Path(path_or_dir)
    if p.is_dir():
        found = sorted(p.glob("**/*.pt.trace.json"), key=lambda f: f.stat().st_mtime)
        if not found:
            raise FileNotFoundError(f"no *.pt.trace.json under {p}: was --profile-execution True set?")
        p = found[-1]
    return json.loads(p.read_text())


def _shape(event: dict) -> tuple[int, ...]:
    dims = event.get("args", {}).get("Input Dims") or [[[]]]
    first = dims[0][0] if dims[0] and isinstance(dims[0][0], list) else dims[0]
    return tuple(first)


def all_reduces_per_step(trace: dict) -> list[dict]:
    """Rows ``{shape, numel, per_step}`` of the all-reduces (mean over the traced steps)."""
    return ops_per_step(trace, ALLREDUCE)


def ops_per_step(trace: dict, op: str) -> list[dict]:
    """Rows ``{shape, numel, per_step}`` of operator ``op`` (mean over the traced steps), the
    most frequent shape first."""
    events = trace["traceEvents"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("no ProfilerStep spans in this trace: it was not written by a scheduled profiler")
    counts: Counter = Counter()
    for e in events:
        if e.get("name") != op:
            continue
        if any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps):
            counts[_shape(e)] += 1
    rows = []
    for shape, n in counts.most_common():
        numel = 1
        for d in shape:
            numel *= d
        rows.append({"shape": shape, "numel": numel, "per_step": n / len(steps)})
    return rows
