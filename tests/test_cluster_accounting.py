"""Job accounting on a private cluster: slurmdbd + MariaDB, read back with ``sacct``."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from distlab.cluster import ClusterPaths, accounting, daemons
from tests.test_cluster import private_paths

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    paths = private_paths(tmp_path_factory.mktemp("acct") / "cluster")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAB_CLUSTER_DIR", str(paths.root))
        daemons.start(paths)
        yield paths
        daemons.stop(paths)


def sacct(paths: ClusterPaths, job: str) -> dict[str, list[str]]:
    """JobID -> [State, Elapsed, MaxRSS, ExitCode] of every step of ``job``."""
    out = subprocess.run(
        ["sacct", "-j", job, "-n", "-P", "--format=JobID,State,Elapsed,MaxRSS,ExitCode"],
        env={**os.environ, "SLURM_CONF": str(paths.conf)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return {line.split("|")[0]: line.split("|")[1:] for line in out.stdout.splitlines()}


def sbatch(paths: ClusterPaths, *args: str) -> str:
    env = {**os.environ, "SLURM_CONF": str(paths.conf)}
    cmd = ["sbatch", "--parsable", "--output=/dev/null", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=True).stdout.strip()


def finished(paths: ClusterPaths, job: str, step: str, timeout: float = 90) -> list[str]:
    """sacct's fields of ``job``'s ``step`` once the step has ended (records arrive asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = sacct(paths, job).get(step)
        if row and row[0] not in ("PENDING", "RUNNING", "COMPLETING"):
            return row
        time.sleep(1)
    raise AssertionError(
        f"job {job} step {step} not finished in sacct after {timeout} s: {sacct(paths, job)}"
    )


def test_finished_job_shows_state_elapsed_and_maxrss(cluster):
    job = sbatch(cluster, "--wrap", "python3 -c 'import time; b = bytearray(200 * 2**20); time.sleep(3)'")
    state, elapsed, maxrss, exit_code = finished(cluster, job, f"{job}.batch")
    assert (state, exit_code) == ("COMPLETED", "0:0")
    hours, minutes, seconds = map(int, elapsed.split(":"))
    assert 3 <= 3600 * hours + 60 * minutes + seconds < 60
    assert maxrss.endswith("K") and int(maxrss[:-1]) >= 200 * 1024  # the 200 MiB buffer was seen
    assert sacct(cluster, job)[job][0] == "COMPLETED"


def test_failed_job_keeps_its_exit_code(cluster):
    job = sbatch(cluster, "--wrap", "exit 3")
    assert finished(cluster, job, job)[0::3] == ["FAILED", "3:0"]


def test_database_listens_on_loopback_only(cluster):
    with socket.socket() as s:  # the port is taken on 127.0.0.1 ...
        assert s.connect_ex(("127.0.0.1", cluster.db_port)) == 0
    addresses = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    for address in addresses - {"127.0.0.1"}:  # ... and nowhere else
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((address, cluster.db_port)) != 0
    password = cluster.root / "mysql" / "slurm.pass"
    assert oct(password.stat().st_mode)[-3:] == "600"
    assert oct((cluster.root / "slurmdbd.conf").stat().st_mode)[-3:] == "600"


def test_database_that_will_not_start_is_named_with_its_log(tmp_path):
    paths = private_paths(tmp_path / "cluster")
    paths.log_dir.mkdir(parents=True)
    with socket.socket() as s:  # MariaDB's port taken behind the port check's back
        s.bind(("127.0.0.1", paths.db_port))
        s.listen()
        with pytest.raises(daemons.ClusterError, match=r"(?s)MariaDB .*exited .*mariadb\.log.*in use"):
            accounting.start(paths)
