"""Start, stop and restart of a second, private instance of the local cluster.

It runs beside the main one (own folder, own ports), so the tests never disturb running work.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from distlab.cluster import ClusterPaths, cgroups, daemons, process
from distlab.local_ranks import free_port
from tests.conftest import cluster_available

pytestmark = [pytest.mark.timeout(300), pytest.mark.mostly_waits]


def private_paths(root: Path) -> ClusterPaths:
    """A private cluster's folder and free ports (skips where the cluster cannot run)."""
    if os.geteuid() != 0 or not cluster_available():
        pytest.skip("needs root and the Slurm packages (./lab setup)")
    base = free_port()
    while any(process.port_busy(base + i) for i in range(5)):
        base = free_port()
    return ClusterPaths(root=root, port_base=base)


@pytest.fixture
def private_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CLUSTER_DIR", str(tmp_path / "cluster"))
    paths = private_paths(tmp_path / "cluster")
    yield paths
    daemons.stop(paths)


def srun_hostnames(paths: ClusterPaths) -> list[str]:
    out = subprocess.run(
        ["srun", "-N2", "hostname"],
        env={**os.environ, "SLURM_CONF": str(paths.conf)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return sorted(out.stdout.split())


def test_start_stop_restart_are_safe_to_repeat(private_cluster):
    paths = private_cluster
    assert "idle node[1-2]" in daemons.start(paths)
    assert "idle node[1-2]" in daemons.start(paths)  # second start: checks and returns
    assert srun_hostnames(paths) == ["node1", "node2"]
    assert daemons.is_up(paths)
    assert "stopped" in daemons.stop(paths)
    assert not daemons.is_up(paths)
    assert not any(cgroups.cluster_folder(paths, c).exists() for c in cgroups.CONTROLLERS)
    daemons.stop(paths)  # stopping twice is harmless
    assert "slurmctld  stopped" in daemons.status(paths)
    assert "slurmdbd   stopped" in daemons.status(paths)
    assert "plain `sinfo` (no SLURM_CONF) reads /etc/slurm/slurm.conf" in daemons.status(paths)
    assert "idle node[1-2]" in daemons.start(paths)  # restart keeps the key and the state
    assert srun_hostnames(paths) == ["node1", "node2"]


def test_stop_with_a_running_job_cancels_it(private_cluster):
    paths = private_cluster
    daemons.start(paths)
    env = {**os.environ, "SLURM_CONF": str(paths.conf)}
    subprocess.run(
        ["sbatch", "--wrap", "sleep 300", "--output=/dev/null"],
        env=env,
        check=True,
        capture_output=True,
        timeout=30,
    )
    assert "(1 job(s) cancelled)" in daemons.stop(paths)
    assert not daemons.is_up(paths)


def test_stale_pid_files_are_ignored(private_cluster):
    paths = private_cluster
    paths.root.mkdir(parents=True)
    paths.ctld_pid.write_text("999999\n")  # a daemon that died without cleaning up
    assert "idle node[1-2]" in daemons.start(paths)


@pytest.mark.parametrize("port", ["ctld_port", "slurmd_port", "dbd_port", "db_port"])
def test_port_held_by_another_program_is_reported(private_cluster, port):
    import socket

    number = private_cluster.slurmd_port(1) if port == "slurmd_port" else getattr(private_cluster, port)
    with socket.socket() as s:
        s.bind(("0.0.0.0", number))
        s.listen()
        with pytest.raises(daemons.ClusterError, match=rf"port\(s\) \[{number}\].*LAB_CLUSTER_PORT.*base\+4"):
            daemons.start(private_cluster)


def test_not_root_is_told_what_to_do(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(daemons.ClusterError, match="run as root"):
        daemons._check_prerequisites()


def test_missing_package_is_named(monkeypatch):
    import shutil

    real = shutil.which
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda exe: None if exe == "slurmd" else real(exe))
    with pytest.raises(daemons.ClusterError, match=r"missing Debian packages: slurmd; run `./lab setup`"):
        daemons._check_prerequisites()
