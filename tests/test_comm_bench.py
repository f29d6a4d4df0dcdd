"""Bandwidth arithmetic (nccl-tests' factors), size parsing, the memory check, a real tiny sweep
whose CSV rows obey the arithmetic, the plot, and the launch guards of the entry scripts."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch

from distlab import REPO_ROOT
from distlab.comm import bench, launch
from distlab.comm.plot import plot_busbw
from distlab.distributed import DistContext
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(120)


def test_bus_factors_match_nccl_tests() -> None:
    # 1 GB in 1 s is 1 GB/s of algorithm bandwidth for every op
    assert bench.algbw(10**9, 1.0) == pytest.approx(1.0)
    # all_reduce over 4 ranks: busbw = algbw x 2 (4 - 1) / 4 = 1.5 x algbw
    assert bench.busbw("all_reduce", 4 * 2**20, 0.01, 4) == pytest.approx(4 * 2**20 / 0.01 / 1e9 * 1.5)
    assert bench.busbw("ring_all_reduce", 10**9, 1.0, 8) == pytest.approx(14 / 8)
    # all_gather / reduce_scatter: (n - 1) / n; with 2 ranks half the data crosses the link
    assert bench.busbw("all_gather", 10**9, 1.0, 2) == pytest.approx(0.5)
    assert bench.busbw("reduce_scatter", 10**9, 2.0, 4) == pytest.approx(0.5 * 3 / 4)
    assert bench.busbw("broadcast", 10**9, 1.0, 16) == pytest.approx(1.0)
    assert bench.busbw("sendrecv", 10**9, 1.0, 2) == pytest.approx(1.0)
    assert set(bench.BUS_FACTOR) == set(bench.OPS)


def test_sizes_parse_and_range() -> None:
    assert bench.parse_size("1K") == 1024
    assert bench.parse_size("4M") == 4 * 2**20
    assert bench.parse_size("4MiB") == 4 * 2**20
    assert bench.parse_size("1.5k") == 1536
    assert bench.parse_size("2048") == 2048
    with pytest.raises(ValueError, match="'4Q' is not a message size"):
        bench.parse_size("4Q")
    assert bench.message_sizes(1024, 4 * 2**20) == [1024 * 4**i for i in range(7)]
    assert bench.message_sizes(1024, 5000, factor=2) == [1024, 2048, 4096]
    with pytest.raises(ValueError, match="bad size range"):
        bench.message_sizes(4096, 1024)


def test_absurd_size_refused_before_allocation() -> None:
    with pytest.raises(ValueError, match=r"--max-size 1\.0 TiB needs about .* choose --max-size"):
        bench.check_memory(2**40, 2, torch.device("cpu"))
    bench.check_memory(2**20, 2, torch.device("cpu"))  # 1 MiB fits anywhere


def _sweep_worker(ctx: DistContext, out: str) -> None:
    rows = bench.sweep(
        bench.OPS,
        [1024, 4096],
        device=ctx.device,
        backend="gloo",
        label="test",
        nodes=1,
        time_budget_s=6.0,
        warmup=1,
        max_iters=3,
        report=lambda _: None,
    )
    if ctx.rank == 0:
        bench.write_results(rows, out)


def test_real_sweep_writes_consistent_rows(tmp_path) -> None:
    world, out = 2, tmp_path / "bw.csv"
    run_gloo(_sweep_worker, world, str(out))
    rows = bench.read_results(out)
    assert {r.op for r in rows} == set(bench.OPS)
    for r in rows:
        assert r.world_size == world and r.iters >= 1 and r.time_us > 0
        assert r.bytes % (world * bench.ELEM) == 0  # a whole number of elements per rank
        assert r.algbw_GBps == pytest.approx(r.bytes / (r.time_us * 1e-6) / 1e9, rel=1e-6)
        assert r.busbw_GBps == pytest.approx(r.algbw_GBps * bench.BUS_FACTOR[r.op](world), rel=1e-6)
    assert out.with_suffix(".json").exists()
    with open(out) as f:
        assert next(csv.reader(f))[:3] == ["label", "op", "bytes"]
    png = plot_busbw({"test": out, "again": out}, tmp_path / "busbw.png", title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_spawn_refused_under_a_launcher(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        launch.LaunchError, match=r"refusing to --spawn 2: this process is already rank 1 of 2"
    ):
        launch.check_spawn_allowed(2, "demo.py")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    launch.check_spawn_allowed(2, "demo.py")  # no launcher: allowed
    with pytest.raises(launch.LaunchError, match="spawn at least 2"):
        launch.check_spawn_allowed(1, "demo.py")


def _run_script(*args: str) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "SLURM_", "OMPI_", "MASTER_"))
    }
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_scripts_fail_clearly_before_starting() -> None:
    single = _run_script("code/p2p_demo.py")
    assert single.returncode == 2
    assert "needs at least 2 processes but was started as 1" in single.stderr
    unknown = _run_script("code/collectives_demo.py", "--spawn", "2", "--collectives", "allreduce")
    assert unknown.returncode == 2 and "did you mean 'all_reduce'" in unknown.stderr
    absurd = _run_script("code/bandwidth_bench.py", "--spawn", "2", "--max-size", "1T")
    assert absurd.returncode == 2 and "choose --max-size" in absurd.stderr
    assert "spawning" not in absurd.stdout  # refused before any process started


def test_log_lines_sorted_by_rank() -> None:
    lines = ["[rank 10/12 b] y", "[rank 2/12 a] first", "[rank 0/12 c] z", "[rank 2/12 a] second"]
    assert launch.by_rank(lines) == [
        "[rank 0/12 c] z",
        "[rank 2/12 a] first",
        "[rank 2/12 a] second",
        "[rank 10/12 b] y",
    ]
