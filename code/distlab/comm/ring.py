"""All-reduce written by hand over send/recv: reduce-scatter, then all-gather, around a ring.

Split the flat tensor of N elements into n chunks ``c_0 .. c_{n-1}`` (``torch.tensor_split``:
sizes differ by at most one, some are empty when N < n). Rank r sends to r + 1 and receives
from r - 1 (mod n).

Reduce-scatter, steps s = 0 .. n-2: send ``c_{(r - s) % n}``, receive ``c_{(r - s - 1) % n}`` and
add it to the local copy. After n - 1 steps rank r holds the full reduction of ``c_{(r + 1) % n}``.

All-gather, steps s = 0 .. n-2: send ``c_{(r + 1 - s) % n}``, receive ``c_{(r - s) % n}`` and
overwrite the local copy. Afterwards every rank holds every reduced chunk.

Each rank sends 2 (n - 1) chunks of about N / n elements: ``2 (n - 1) / n x N`` elements, the
bus-bandwidth factor of all-reduce, independent of n. The neighbour that receives a chunk is
the one that sends the same-index chunk the other way, so both sides agree on its length,
and empty chunks are simply skipped by both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "SUM": torch.add,
    "MAX": torch.maximum,
    "MIN": torch.minimum,
    "PRODUCT": torch.mul,
}


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> None:
    """Send ``send`` to ``dst`` while receiving ``recv`` from ``src``, as one batch.

    ``batch_isend_irecv`` posts both before waiting; with nccl it also groups them into one
    launch, which a ring needs (every rank receives and sends at the same time).
    """
    ops = []
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def ring_all_reduce(
    tensor: torch.Tensor,
    op: str = "SUM",
    group: dist.ProcessGroup | None = None,
    trace: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` (any shape, any length) over a ring; returns ``tensor``.

    Same contract as ``dist.all_reduce(tensor, op)`` for op in SUM, MAX, MIN, PRODUCT. ``trace``,
    when given, receives one line per step (which chunk went where).
    """
    if op not in _COMBINE:
        raise ValueError(f"ring_all_reduce: unknown op {op!r}: choose from {', '.join(_COMBINE)}")
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    r = dist.get_rank(group)
    right = r + 1 if r + 1 < n else 0
    left = r - 1 if r > 0 else n - 1
    if group is not None:  # send/recv address global ranks
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    flat = tensor.contiguous().view(-1)  # (N,) a view of tensor when it is contiguous
    chunks = torch.tensor_split(flat, n)  # n views, lengths N // n or N // n + 1
    scratch = torch.empty_like(chunks[0])  # the largest chunk is the first one
    combine = _COMBINE[op]

    for s in range(n - 1):  # reduce-scatter
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        incoming = scratch[: chunks[recv_i].numel()]
        exchange(chunks[send_i], right, incoming, left, group)
        chunks[recv_i].copy_(combine(chunks[recv_i], incoming))
        if trace:
            trace(
                f"reduce-scatter step {s}: sent chunk {send_i} to rank {right}, added chunk {recv_i} from rank {left}"
            )

    for s in range(n - 1):  # all-gather
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        exchange(chunks[send_i], right, chunks[recv_i], left, group)
        if trace:
            trace(
                f"all-gather step {s}: sent reduced chunk {send_i} to rank {right}, got reduced chunk {recv_i}"
            )

    if flat.data_ptr() != tensor.data_ptr():  # tensor was not contiguous: copy the result back
        tensor.copy_(flat.view_as(tensor))
    return tensor
