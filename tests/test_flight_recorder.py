"""distlab.flight_recorder against PyTorch's own analyzer (``torchfrtrace``), on real gloo ranks.

Two ranks of a gloo group with a 3 s timeout; rank 1 skips the third all-reduce of the default
group. Rank 0 times out in it. Each rank dumps its record (rank 1 after rank 0's timeout), or only
rank 0 when rank 1 plays a frozen rank (it writes nothing). The checks: PyTorch's analyzer reads
the dumps (which it cannot with gloo's own ``pg_config``) and finds rank 1 missing from sequence
number 4 of the default group, or names the rank without a dump; :func:`hang_report` says the
same, with the group's description and the node.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab import flight_recorder
from distlab.local_ranks import free_port, spawn_ranks, torchrun_env

pytestmark = pytest.mark.timeout(120)


def skip_one_all_reduce(rank: int, port: int, prefix: str, rank1_dumps: bool) -> None:
    os.environ.update(torchrun_env(rank, 2, port), TORCH_FR_BUFFER_SIZE="100")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    tp = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3), group_desc="tp")
    hosts = flight_recorder.start(prefix)
    x = torch.ones(3, 5)
    dist.all_reduce(x)
    dist.all_reduce(x, group=tp)
    waiting = None
    try:
        if rank == 0:
            dist.all_reduce(
                x
            )  # #4 of the default group (start()'s all_gather_object made 2); rank 1 never joins
        else:
            time.sleep(5)
    except RuntimeError as exc:
        assert "Timed out waiting" in str(exc)
        waiting = flight_recorder.waiting_in(exc)
        assert waiting["op"].startswith("gloo:all_reduce") and waiting["sizes"] == [[3, 5]], waiting
    if rank == 0 or rank1_dumps:
        flight_recorder.dump(prefix, rank, hosts, waiting)
    dist.destroy_process_group()


def run(tmp_path: Path, rank1_dumps: bool) -> tuple[str, list[int], str]:
    prefix = str(tmp_path / "fr" / "rank_")
    spawn_ranks(skip_one_all_reduce, (free_port(), prefix, rank1_dumps), nprocs=2)
    torchfrtrace = Path(sys.executable).with_name("torchfrtrace")
    out = subprocess.run([str(torchfrtrace), str(tmp_path / "fr")], capture_output=True, text=True)
    missing, lines = flight_recorder.hang_report(
        flight_recorder.read_dumps(prefix), 2, flight_recorder.read_hosts(prefix)
    )
    return out.stdout + out.stderr, missing, "\n".join(lines)


def test_a_skipped_collective_is_found_by_pytorchs_analyzer_and_ours(tmp_path):
    analyzer, missing, report = run(tmp_path, rank1_dumps=True)
    assert "Not all ranks joining collective, sequence number: 4" in analyzer, analyzer[-3000:]
    assert "missing ranks: {1}" in analyzer and "group info: 0:default_pg" in analyzer
    assert missing == []
    assert "> hang: ranks [1] did not join gloo:all_reduce #4 of group 0 (default_pg) [0, 1]" in report, (
        report
    )
    assert f"rank 1 on {socket.gethostname()}" in report


def test_a_rank_without_a_dump_is_named(tmp_path):
    analyzer, missing, report = run(tmp_path, rank1_dumps=False)
    assert "Missing dump files from ranks {1}" in analyzer, analyzer[-3000:]
    assert missing == [1]
    assert "> hang: ranks [1] did not join gloo:all_reduce #4 of group 0 (default_pg) [0, 1]" in report, (
        report
    )
    assert "> hang: rank 1 on" in report and "wrote no flight record" in report
