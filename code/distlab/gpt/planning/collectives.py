"""Record the collectives a step issues: operation, process group, group size, bytes.

:func:`record_collectives` replaces ``torch.distributed``'s collective functions (the ones the
engine calls through ``dist.<name>``) by wrappers that note each call, then call the original.
It runs the same on a real gloo or NCCL group and on a dry run's fake process group, so the list a
dry run prints can be checked against the list a real step issues (``tests/test_gpt_dry_run.py``).

Bytes of one call, NCCL-tests' "size" convention (the whole buffer, not what one rank sends)::

    all_reduce, broadcast           the tensor
    all_gather (_single)            the gathered output: p x the input
    reduce_scatter (_single)        the input: p x the output
    all_to_all_single               the input
    send, recv (batch_isend_irecv)  the tensor of each P2P operation

The step-time model applies each algorithm's factor to these sizes (``step_model.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.gpt.parallel_state import ParallelState

#: ParallelState's groups by the name a report gives them, in rank order of the layout.
GROUPS = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp", "embedding")


@dataclass(frozen=True)
class Collective:
    """One call: ``op`` over ``group`` (a name from :data:`GROUPS`, or "world") of ``size`` ranks,
    moving ``nbytes`` (the whole buffer, see the module docstring)."""

    op: str
    group: str
    size: int
    nbytes: int


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_name(group, state: ParallelState | None) -> str:
    if state is not None:
        for name in GROUPS:
            if group is not None and getattr(state, f"{name}_group") is group:
                return name
    return "world"


@contextlib.contextmanager
def record_collectives(state: ParallelState | None = None) -> Iterator[list[Collective]]:
    """Within the block, every ``dist`` collective is appended to the yielded list (groups named
    after ``state``'s; a group that is none of them, or the default group, is "world")."""
    calls: list[Collective] = []

    def note(op: str, group, nbytes: int) -> None:
        size = dist.get_world_size(group)
        calls.append(Collective(op, _group_name(group, state), size, nbytes))

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        note("all_reduce", group, _bytes(tensor))
        return originals["all_reduce"](tensor, op=op, group=group, async_op=async_op)

    def broadcast(tensor, src=None, group=None, async_op=False, **kw):
        note("broadcast", group, _bytes(tensor))
        return originals["broadcast"](tensor, src=src, group=group, async_op=async_op, **kw)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        note("all_gather", group, sum(_bytes(t) for t in tensor_list))
        return originals["all_gather"](tensor_list, tensor, group=group, async_op=async_op)

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        note("reduce_scatter", group, sum(_bytes(t) for t in input_list))
        return originals["reduce_scatter"](output, input_list, op=op, group=group, async_op=async_op)

    def all_gather_single(output, input, group=None, async_op=False):
        note("all_gather", group, _bytes(output))
        return originals["all_gather_single"](output, input, group=group, async_op=async_op)

    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        note("reduce_scatter", group, _bytes(input))
        return originals["reduce_scatter_single"](output, input, op=op, group=group, async_op=async_op)

    def all_to_all_single(output, input, *args, group=None, **kw):
        note("all_to_all", group, _bytes(input))
        return originals["all_to_all_single"](output, input, *args, group=group, **kw)

    def batch_isend_irecv(ops):
        for p2p in ops:
            note("send" if p2p.op is dist.isend else "recv", p2p.group, _bytes(p2p.tensor))
        return originals["batch_isend_irecv"](ops)

    wrappers = {f.__name__: f for f in (all_reduce, broadcast, all_gather, reduce_scatter)}
    wrappers |= {
        "all_gather_single": all_gather_single,
        "reduce_scatter_single": reduce_scatter_single,
        "all_to_all_single": all_to_all_single,
        "batch_isend_irecv": batch_isend_irecv,
    }
    originals = {name: getattr(dist, name) for name in wrappers}
    for name, wrapper in wrappers.items():
        setattr(dist, name, functools.wraps(originals[name])(wrapper))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def summarize(calls: list[Collective]) -> list[tuple[Collective, int]]:
    """Identical calls counted once: ``(call, count)`` in the order each first appeared."""
    return list(Counter(calls).items())
