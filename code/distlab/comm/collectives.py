"""Every collective of ``torch.distributed`` on small, recognisable tensors, with expected results.

Rank ``r`` of a group of ``n`` starts from ``x(r) = [10 r + 1, 10 r + 2]`` (shape (2,)), so each
result shows where its numbers came from. With n = 4::

    broadcast(src=0)      every rank: x(0)                          = [1, 2]
    reduce(dst=0, SUM)    rank 0:    x(0) + x(1) + x(2) + x(3)      = [64, 68]
    all_reduce(SUM)       every rank: the same sum                  = [64, 68]
    all_reduce(MAX)       every rank: x(3)                          = [31, 32]
    scatter(src=0)        rank r: chunk r of arange(2n)             = [2r, 2r + 1]
    gather(dst=0)         rank 0:    stack(x(0..3))                 (4, 2)
    all_gather            every rank: stack(x(0..3))                (4, 2)
    reduce_scatter(SUM)   rank r: sum_i chunk r of (arange(2n) + 100 i)
    all_to_all            rank r: [10 i + r for i]  (the transpose of the input [10 r + j for j])
    barrier               no data; rank r arrives r x 0.2 s late, everyone leaves with the last

Each demo runs on the default group (``group=None``) or on a subgroup made by ``new_group``.
Inputs always follow the *global* rank (rank 3 holds ``x(3)`` in any group); positions (which
chunk, who is the root) follow the rank *inside* the group, and the root is translated to its
global rank with ``dist.get_global_rank``. In the even group [0, 2] all_reduce(SUM) gives
``x(0) + x(2) = [22, 24]``.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

Outputs = dict[str, torch.Tensor | None]  # label -> this rank's result (None: this rank gets none)
ALL_REDUCE_OPS = ("SUM", "MAX", "MIN", "PRODUCT")
BARRIER_DELAY_S = 0.2


def x_of(rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global rank ``rank``'s input: ``[10 r + 1, 10 r + 2]``, shape (2,)."""
    return torch.tensor([10.0 * rank + 1, 10.0 * rank + 2], device=device)


def _where(group) -> tuple[int, int, int, int]:
    """``(group rank, group size, global rank, global rank of group rank 0)``."""
    root = 0 if group is None else dist.get_global_rank(group, 0)
    return dist.get_rank(group), dist.get_world_size(group), dist.get_rank(), root


def broadcast(device: torch.device, group=None) -> Outputs:
    _, _, me, root = _where(group)
    t = x_of(me, device)
    dist.broadcast(t, src=root, group=group)
    return {"": t}


def reduce(device: torch.device, group=None) -> Outputs:
    rank, _, me, root = _where(group)
    t = x_of(me, device)
    dist.reduce(t, dst=root, op=dist.ReduceOp.SUM, group=group)
    return {"": t if rank == 0 else None}  # other ranks' buffers are scratch


def all_reduce(device: torch.device, group=None) -> Outputs:
    out: Outputs = {}
    for op in ALL_REDUCE_OPS:
        t = x_of(dist.get_rank(), device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        out[op] = t
    return out


def scatter(device: torch.device, group=None) -> Outputs:
    rank, world, _, root = _where(group)
    out = torch.empty(2, device=device)
    chunks = list(torch.arange(2.0 * world, device=device).chunk(world)) if rank == 0 else None
    dist.scatter(out, chunks, src=root, group=group)
    return {"": out}


def gather(device: torch.device, group=None) -> Outputs:
    rank, world, me, root = _where(group)
    bufs = [torch.empty(2, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(x_of(me, device), bufs, dst=root, group=group)
    return {"": torch.stack(bufs) if bufs is not None else None}  # (world, 2) on the root


def all_gather(device: torch.device, group=None) -> Outputs:
    _, world, me, _ = _where(group)
    bufs = [torch.empty(2, device=device) for _ in range(world)]
    dist.all_gather(bufs, x_of(me, device), group=group)
    return {"": torch.stack(bufs)}  # (world, 2)


def reduce_scatter(device: torch.device, group=None) -> Outputs:
    _, world, me, _ = _where(group)
    inp = torch.arange(2.0 * world, device=device) + 100 * me  # (2 world,)
    out = torch.empty(2, device=device)
    dist.reduce_scatter(out, list(inp.chunk(world)), op=dist.ReduceOp.SUM, group=group)
    return {"": out}


def all_to_all(device: torch.device, group=None) -> Outputs:
    _, world, me, _ = _where(group)
    inp = torch.tensor([10.0 * me + j for j in range(world)], device=device)  # (world,): chunk j -> rank j
    out = torch.empty(world, device=device)
    dist.all_to_all_single(out, inp, group=group)
    return {"": out}


def barrier(device: torch.device, group=None) -> Outputs:
    time.sleep(BARRIER_DELAY_S * dist.get_rank(group))
    t0 = time.perf_counter()
    dist.barrier(group=group)
    return {"waited_s": torch.tensor([time.perf_counter() - t0])}


DEMOS: dict[str, Callable[..., Outputs]] = {
    "broadcast": broadcast,
    "reduce": reduce,
    "all_reduce": all_reduce,
    "scatter": scatter,
    "gather": gather,
    "all_gather": all_gather,
    "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all,
    "barrier": barrier,
}


def expected(name: str, rank: int, members: list[int]) -> Outputs:
    """What ``DEMOS[name]`` must return on group rank ``rank`` of the group of global ``members``.

    Computed locally with plain torch; ``members = list(range(world))`` for the default group.
    """
    world = len(members)
    xs = torch.stack([x_of(m) for m in members])  # (world, 2)
    mine = torch.arange(2.0 * world)[2 * rank : 2 * rank + 2]  # chunk ``rank`` of arange(2 world)
    if name == "broadcast":
        return {"": xs[0]}
    if name == "reduce":
        return {"": xs.sum(0) if rank == 0 else None}
    if name == "all_reduce":
        return {"SUM": xs.sum(0), "MAX": xs.amax(0), "MIN": xs.amin(0), "PRODUCT": xs.prod(0)}
    if name == "scatter":
        return {"": mine}
    if name == "gather":
        return {"": xs if rank == 0 else None}
    if name == "all_gather":
        return {"": xs}
    if name == "reduce_scatter":
        return {"": sum(mine + 100 * m for m in members)}
    if name == "all_to_all":
        return {"": torch.tensor([10.0 * m + rank for m in members])}
    if name == "barrier":  # a rank waits for the latest one, minus its own delay
        return {"waited_s": torch.tensor([BARRIER_DELAY_S * (world - 1 - rank)])}
    raise KeyError(name)


def parse_names(spec: str, known: list[str]) -> list[str]:
    """``"all"`` or a comma list -> names; an unknown name fails with the known ones and a guess."""
    if spec.strip() == "all":
        return list(known)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for name in names:
        if name not in known:
            guess = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            raise ValueError(f"unknown collective {name!r}{hint}: choose from {', '.join(known)} or 'all'")
    if not names:
        raise ValueError(f"no collective given: choose from {', '.join(known)} or 'all'")
    return names


def even_odd_groups(world: int, timeout) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``new_group`` for even and for odd ranks. Every rank must create both, in the same order."""
    evens = dist.new_group(list(range(0, world, 2)), timeout=timeout)
    odds = dist.new_group(list(range(1, world, 2)), timeout=timeout)
    return evens, odds


def check_all_gather(
    ctx,
    fn: Callable[[torch.Tensor], list[torch.Tensor]],
    shapes: tuple[tuple[int, ...], ...] = ((1,), (3,), (2, 5)),
) -> bool:
    """Compare ``fn(x)`` with ``dist.all_gather`` on every rank; print one verdict line per shape.

    For the exercise: ``fn(x)`` must return ``[x of rank 0, ..., x of rank n-1]``. A function that
    raises ``NotImplementedError`` is reported as not done yet (the job still succeeds).
    """
    from distlab.comm.launch import say

    all_ok = True
    for shape in shapes:
        gen = torch.Generator().manual_seed(100 + ctx.rank)
        x = torch.randint(-9, 10, shape, generator=gen).float().to(ctx.device)
        want = [torch.empty_like(x) for _ in range(ctx.world_size)]
        dist.all_gather(want, x)
        try:
            got = fn(x.clone())
        except NotImplementedError as err:
            say(ctx, f"my_all_gather: not implemented yet ({err})")
            return False
        ok = len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=False))
        all_ok &= ok
        say(
            ctx,
            f"my_all_gather shape {tuple(shape)}: {'ok' if ok else 'WRONG'}"
            + ("" if ok else f" got {[g.tolist() for g in got]}, expected {[w.tolist() for w in want]}"),
        )
    return all_ok
