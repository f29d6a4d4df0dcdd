"""Every collective demo, on the default group and on new_group subgroups, and the p2p shifts.

One group of gloo processes per world size runs all checks (spawning costs seconds on 2 cores);
a failing check raises in its rank and ``torch.multiprocessing.spawn`` re-raises it here.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from distlab.comm import collectives as col
from distlab.comm import p2p
from distlab.distributed import DistContext
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(120)


def _check_outputs(name: str, got: col.Outputs, want: col.Outputs, rank: int) -> None:
    assert got.keys() == want.keys(), (name, got.keys(), want.keys())
    for label, out in got.items():
        if name == "barrier":  # rank r arrives r x delay late; the earliest waits for the latest
            assert out.item() >= 0.5 * want[label].item(), (rank, out.item(), want[label].item())
            continue
        if want[label] is None:
            assert out is None, f"{name}: rank {rank} should get no result, got {out}"
        else:
            assert_close(out, want[label], msg=lambda m, n=name, lab=label: f"{n}({lab}) rank {rank}: {m}")


def _worker(ctx: DistContext) -> None:
    rank, world = ctx.rank, ctx.world_size
    everyone = list(range(world))
    for name, demo in col.DEMOS.items():  # default group
        _check_outputs(name, demo(ctx.device), col.expected(name, rank, everyone), rank)

    evens, odds = col.even_odd_groups(world, datetime.timedelta(seconds=60))
    group = evens if rank % 2 == 0 else odds
    members = list(range(rank % 2, world, 2))
    g_rank, g_world = members.index(rank), len(members)
    assert dist.get_rank(group) == g_rank and dist.get_world_size(group) == g_world
    for name in (
        "broadcast",
        "reduce",
        "all_reduce",
        "scatter",
        "gather",
        "all_gather",
        "reduce_scatter",
    ):
        got = col.DEMOS[name](ctx.device, group)
        _check_outputs(name, got, col.expected(name, g_rank, members), rank)
    # spelled out once: a subgroup all_reduce sums the global inputs of its members only
    sub = col.DEMOS["all_reduce"](ctx.device, group)["SUM"]
    assert_close(sub, sum(col.x_of(m) for m in members))
    if world == 4:
        assert_close(sub, torch.tensor([22.0, 24.0]) if rank % 2 == 0 else torch.tensor([42.0, 44.0]))

    left = (rank - 1) % world
    assert_close(p2p.blocking_shift(ctx), p2p.payload(left))
    before, after = p2p.nonblocking_shift(ctx, delay_s=0.3)
    assert_close(before, torch.full((3,), -1.0))  # the neighbour had not sent yet
    assert_close(after, p2p.payload(left))


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_and_p2p(world: int) -> None:
    run_gloo(_worker, world)


def test_expected_values_by_hand() -> None:
    """The reference itself, against numbers worked out on paper for 4 ranks."""
    four = [0, 1, 2, 3]
    assert col.expected("all_reduce", 0, four)["SUM"].tolist() == [64.0, 68.0]
    assert col.expected("all_reduce", 2, four)["MAX"].tolist() == [31.0, 32.0]
    assert col.expected("scatter", 3, four)[""].tolist() == [6.0, 7.0]
    assert col.expected("reduce_scatter", 1, four)[""].tolist() == [608.0, 612.0]
    assert col.expected("all_to_all", 1, four)[""].tolist() == [1.0, 11.0, 21.0, 31.0]
    assert col.expected("gather", 1, four)[""] is None
    assert col.expected("all_reduce", 1, [1, 3])["SUM"].tolist() == [42.0, 44.0]


def test_unknown_collective_is_named_with_a_guess() -> None:
    names = [*col.DEMOS, "ring_all_reduce"]
    assert col.parse_names("all", names) == names
    assert col.parse_names("all_reduce, barrier", names) == ["all_reduce", "barrier"]
    with pytest.raises(ValueError, match=r"unknown collective 'allreduce' \(did you mean 'all_reduce'\?\)"):
        col.parse_names("allreduce", names)
    with pytest.raises(ValueError, match="no collective given"):
        col.parse_names(" , ", names)


def test_diagrams_are_drawn(tmp_path) -> None:
    from distlab.comm import diagrams

    path = diagrams.draw("reduce_scatter", tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(diagrams.DIAGRAMS) >= {
        "broadcast",
        "scatter",
        "gather",
        "reduce",
        "all_reduce",
        "all_gather",
        "reduce_scatter",
    }
    committed = {p.stem for p in (diagrams.REPO_ROOT / "images" / "collectives").glob("*.png")}
    assert committed == set(diagrams.DIAGRAMS)  # every picture the notebook shows is committed
