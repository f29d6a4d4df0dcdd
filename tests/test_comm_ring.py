"""The hand-written ring all-reduce equals dist.all_reduce for any world size and length."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from distlab.comm.ring import ring_all_reduce
from distlab.distributed import DistContext
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(120)

# 0 and lengths < world leave chunks empty; primes are never divisible by the world size
LENGTHS = [0, 1, 2, 3, 5, 7, 13, 1001]
OTHER_OPS_LENGTHS = (3, 13)  # MAX, MIN, PRODUCT take the same code path: a few lengths suffice


def _worker(ctx: DistContext) -> None:
    rank, world = ctx.rank, ctx.world_size
    gen = torch.Generator().manual_seed(rank)
    for length in LENGTHS:
        for op in ("SUM", "MAX", "MIN", "PRODUCT") if length in OTHER_OPS_LENGTHS else ("SUM",):
            x = torch.randn(length, generator=gen)  # (length,)
            ref = x.clone()
            dist.all_reduce(ref, op=getattr(dist.ReduceOp, op))
            out = ring_all_reduce(x, op=op)
            assert out is x  # in place, like dist.all_reduce
            assert_close(x, ref, msg=lambda m, n=length, o=op: f"world {world} len {n} {o}: {m}")

    # any shape; a non-contiguous tensor is reduced in place too
    y = torch.randn(6, 5, generator=gen).t()  # (5, 6), not contiguous
    ref = y.clone()
    dist.all_reduce(ref)
    ring_all_reduce(y)
    assert_close(y, ref)

    # on a subgroup: ranks 1..world-1 (global ranks differ from group ranks)
    sub = dist.new_group(list(range(1, world)), timeout=datetime.timedelta(seconds=60))
    if rank >= 1:
        z = torch.arange(7.0) * rank  # (7,)
        ring_all_reduce(z, group=sub)
        assert_close(z, torch.arange(7.0) * sum(range(1, world)))

    with pytest.raises(ValueError, match="unknown op 'AVGX'"):
        ring_all_reduce(torch.ones(3), op="AVGX")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_all_reduce(world: int) -> None:
    run_gloo(_worker, world)
