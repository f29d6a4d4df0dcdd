"""Point-to-point: one rank's tensor into another rank's buffer.

Ring shift: rank ``r`` sends its payload to ``(r + 1) % n`` and receives from ``(r - 1) % n``::

    payload(r) = [100 r, 100 r + 1, 100 r + 2]          # (3,) float32
    after the shift, rank r holds payload((r - 1) % n)

Blocking ``send``/``recv`` return only when the transfer is done, so if every rank called
``send`` first, every rank would wait for a receiver that is itself still sending (deadlock,
or luck when the library buffers small messages). Even ranks send first and odd ranks receive
first; that breaks the cycle for any ``n >= 2``.

Non-blocking ``isend``/``irecv`` return a request at once; the buffer is only valid after
``request.wait()``. The demo posts ``irecv`` into a buffer of -1s, looks at it *before*
``wait()`` (the neighbour deliberately sends late, so it still holds -1s), then after.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distlab.comm.launch import say
from distlab.distributed import DistContext


def payload(rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """What rank ``rank`` sends: ``[100 r, 100 r + 1, 100 r + 2]``, shape (3,)."""
    return torch.arange(3, dtype=torch.float32, device=device) + 100 * rank


def neighbours(rank: int, world: int) -> tuple[int, int]:
    """``(left, right)`` in the ring: receive from the left, send to the right."""
    return (rank - 1) % world, (rank + 1) % world


def blocking_shift(ctx: DistContext) -> torch.Tensor:
    """Ring shift with blocking send/recv; returns the received tensor, shape (3,)."""
    left, right = neighbours(ctx.rank, ctx.world_size)
    mine = payload(ctx.rank, ctx.device)
    got = torch.empty(3, device=ctx.device)
    if ctx.rank % 2 == 0:
        dist.send(mine, dst=right)
        dist.recv(got, src=left)
    else:
        dist.recv(got, src=left)
        dist.send(mine, dst=right)
    say(ctx, f"blocking: sent {mine.tolist()} to rank {right}, recv got {got.tolist()} from rank {left}")
    return got


def nonblocking_shift(ctx: DistContext, delay_s: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring shift with isend/irecv; returns the buffer as seen before and after ``wait()``.

    Every rank posts its ``irecv`` first and sends only ``delay_s`` later, so the look before
    ``wait()`` happens while no data can have arrived yet.
    """
    left, right = neighbours(ctx.rank, ctx.world_size)
    buf = torch.full((3,), -1.0, device=ctx.device)
    recv_req = dist.irecv(buf, src=left)
    before = buf.clone()  # reading here is a race: legal only because nothing was sent yet
    say(
        ctx,
        f"non-blocking: irecv posted, before wait(): is_completed={recv_req.is_completed()} "
        f"buffer={before.tolist()}",
    )
    time.sleep(delay_s)
    send_req = dist.isend(payload(ctx.rank, ctx.device), dst=right)
    t0 = time.perf_counter()
    recv_req.wait()
    send_req.wait()
    waited_ms = 1e3 * (time.perf_counter() - t0)
    after = buf.clone()
    say(
        ctx,
        f"non-blocking: after wait() ({waited_ms:.1f} ms): is_completed={recv_req.is_completed()} "
        f"buffer={after.tolist()} from rank {left}",
    )
    return before, after
