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

:func:`collectives_per_step` counts every kind of collective by its operator: the process
group's own (``c10d::``; FSDP2 over a 1-D mesh: one ``_allgather_base_`` per unit of
``fully_shard`` and pass, one ``_reduce_scatter_base_`` per unit and step; over a 2-D mesh their
``_coalesced_`` forms) and DTensor's functional collectives (``_c10d_functional::``).
Expert parallelism's ``all_to_all_single`` calls appear as ``c10d::alltoall_base_``
(:func:`ops_per_step` with :data:`ALLTOALL`): per MoE layer and micro-batch, forward sends the
counts (E,), dispatches and combines the tokens (uneven, (rows, h)); backward repeats the last two.

Sequence parallelism (``--sequence-parallel``) replaces the block's (b, s, h) all-reduces by
list-form all-gathers and reduce-scatters of (b, s/t, h) shards (:data:`ALLGATHER`,
:data:`REDUCE_SCATTER`): per layer and micro-batch 2 of each forward (``g`` before each
column-parallel GEMM, ``g-bar`` after each row-parallel one), and in backward 2 reduce-scatters
(dX of the column-parallel GEMMs) and 4 all-gathers (``g-bar``'s backward, and the shard gathered
again for each column-parallel weight gradient). An all-gather or a reduce-scatter sends
(t - 1)/t of the full tensor per rank, an all-reduce twice that: 8 halves in place of 4 all-reduces,
plus the 2 re-gathers that save keeping the gathered input alive (:func:`bytes_sent_per_rank`).

:func:`collective_bytes_per_step` adds up, by kind and dtype, the whole tensor each all-gather
builds and each reduce-scatter reduces (FSDP2's ``_base_`` forms: under ``MixedPrecisionPolicy
(bf16, fp32)`` the all-gathers carry bf16, the reduce-scatters fp32). :func:`memory_per_step`
reads the allocator's ``[memory]`` events (``profile_memory=True``): what is allocated when the
step's backward starts and at its peak, above what was allocated when the step began.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

ALLREDUCE = "c10d::allreduce_"
ALLTOALL = "c10d::alltoall_base_"
ALLGATHER = "c10d::allgather_"  # dist.all_gather(list, tensor): the recorded shape is one shard's
REDUCE_SCATTER = "c10d::reduce_scatter_"  # dist.reduce_scatter(tensor, list): the output shard's


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
    """The shape of the first recorded tensor argument (the first of a tensor list): an
    all-gather's output list is not recorded, its input shard is."""
    dims = [d for d in event.get("args", {}).get("Input Dims") or [] if d] or [[]]
    first = dims[0][0] if dims[0] and isinstance(dims[0][0], list) else dims[0]
    return tuple(first)


#: Operator -> (kind, family).
COLLECTIVES = {
    ALLREDUCE: ("all_reduce", "c10d"),
    ALLGATHER: ("all_gather", "c10d"),
    REDUCE_SCATTER: ("reduce_scatter", "c10d"),
    "c10d::_allgather_base_": ("all_gather", "c10d"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "c10d"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "c10d coalesced"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "c10d coalesced"),
    "_c10d_functional::all_reduce": ("all_reduce", "functional"),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "functional"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "functional"),
}


def _step_spans(events: list[dict]) -> list[dict]:
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("no ProfilerStep spans in this trace: it was not written by a scheduled profiler")
    return steps


def collectives_per_step(trace: dict) -> dict[tuple[str, str], float]:
    """``{(kind, caller): count per step}`` of :data:`COLLECTIVES`, mean over the traced steps."""
    events = trace["traceEvents"]
    steps = _step_spans(events)
    counts: Counter = Counter()
    for e in events:
        if e.get("name") in COLLECTIVES and any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps):
            counts[COLLECTIVES[e["name"]]] += 1
    return {key: n / len(steps) for key, n in sorted(counts.items())}


#: A profiler ``Input type`` -> bytes per element.
_ELEMENT_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}


def collective_bytes_per_step(trace: dict) -> dict[tuple[str, str], float]:
    """``{(kind, dtype): bytes per step}`` of the c10d all-gathers and reduce-scatters on one
    tensor (``_allgather_base_`` / ``_reduce_scatter_base_``, FSDP2 over a 1-D mesh): the size of
    the whole tensor (the larger of output and input), mean over the traced steps."""
    events = trace["traceEvents"]
    steps = _step_spans(events)
    ops = {"c10d::_allgather_base_": "all_gather", "c10d::_reduce_scatter_base_": "reduce_scatter"}
    total: Counter = Counter()
    for e in events:
        if e.get("name") not in ops or not any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps):
            continue
        dims, dtype = e["args"]["Input Dims"][:2], e["args"]["Input type"][0]
        numel = max(math.prod(d) for d in dims)  # (output, input): the whole tensor is the larger
        total[ops[e["name"]], dtype] += numel * _ELEMENT_BYTES[dtype]
    return {key: n / len(steps) for key, n in sorted(total.items())}


def memory_per_step(trace: dict, device_type: int | None = None) -> list[dict]:
    """Per traced step ``{step, backward, peak}``: bytes allocated (the profiler's ``[memory]``
    events of ``device_type``: 0 CPU, 1 CUDA; default CUDA when the trace has it, else CPU) when
    the step's first ``autograd::engine`` operator starts, and at the step's peak, both above what
    was allocated when the step began."""
    events = trace["traceEvents"]
    memory = [e for e in events if e.get("name") == "[memory]"]
    if not memory:
        raise ValueError("no [memory] events in this trace: it was not profiled with profile_memory=True")
    if device_type is None:
        device_type = 1 if any(e["args"].get("Device Type") == 1 for e in memory) else 0
    memory = sorted((e for e in memory if e["args"].get("Device Type") == device_type), key=lambda e: e["ts"])
    backward = sorted(
        e["ts"] for e in events if e.get("ph") == "X" and e["name"].startswith("autograd::engine")
    )
    rows = []
    for s in sorted(_step_spans(events), key=lambda e: e["ts"]):
        end = s["ts"] + s["dur"]
        inside = [e for e in memory if s["ts"] <= e["ts"] <= end]
        start = inside[0]["args"]["Total Allocated"] - inside[0]["args"]["Bytes"]  # before the first event
        bw = next(t for t in backward if s["ts"] <= t <= end)
        at_bw = [e["args"]["Total Allocated"] for e in inside if e["ts"] <= bw][-1]
        peak = max(e["args"]["Total Allocated"] for e in inside)
        rows.append({"step": s["name"], "backward": at_bw - start, "peak": peak - start})
    return rows


def all_reduces_per_step(trace: dict) -> list[dict]:
    """Rows ``{shape, numel, per_step}`` of the all-reduces (mean over the traced steps)."""
    return ops_per_step(trace, ALLREDUCE)


def ops_per_step(trace: dict, op: str) -> list[dict]:
    """Rows ``{shape, numel, per_step}`` of operator ``op`` (mean over the traced steps), the
    most frequent shape first."""
    events = trace["traceEvents"]
    steps = _step_spans(events)
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


def bytes_sent_per_rank(op: str, numel: int, ranks: int, element_bytes: int = 4) -> float:
    """Bytes one rank sends in a ring ``op`` over ``ranks``: 2 (t - 1)/t x the tensor for an
    all-reduce (``numel`` its elements), (t - 1) x the shard for an all-gather or a
    reduce-scatter (``numel`` the shard's, as :func:`ops_per_step` records it)."""
    t = ranks
    if op == ALLREDUCE:
        return 2 * (t - 1) / t * numel * element_bytes
    if op in (ALLGATHER, REDUCE_SCATTER):
        return (t - 1) * numel * element_bytes
    raise ValueError(f"bytes_sent_per_rank knows {ALLREDUCE}, {ALLGATHER}, {REDUCE_SCATTER}; got {op!r}")
