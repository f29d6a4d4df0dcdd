"""What a private cluster records and enforces about jobs: accounting (slurmdbd + MariaDB, read
back with ``sacct``) and memory limits (a job past its ``--mem`` ends OUT_OF_MEMORY)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from distlab import jobs
from distlab.cluster import ClusterPaths, accounting, cgroups, daemons
from distlab.cluster.config import node_memory_mb
from distlab.slurm_job import JobError, JobFailed
from tests.test_cluster import private_paths

pytestmark = [pytest.mark.timeout(300), pytest.mark.mostly_waits]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    paths = private_paths(tmp_path_factory.mktemp("acct") / "cluster")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAB_CLUSTER_DIR", str(paths.root))
        mp.setenv("SLURM_CONF", str(paths.conf))  # for distlab.jobs
        daemons.start(paths)
        yield paths
        daemons.stop(paths)


def sacct(paths: ClusterPaths, job: str) -> dict[str, list[str]]:
    """JobID -> [State, Elapsed, MaxRSS (in KiB: sacct otherwise picks K or M by size), ExitCode] of every step."""
    out = subprocess.run(
        ["sacct", "-j", job, "-n", "-P", "--units=K", "--format=JobID,State,Elapsed,MaxRSS,ExitCode"],
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
    assert maxrss.endswith("K") and float(maxrss[:-1]) >= 200 * 1024  # the 200 MiB buffer was seen
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


def memory_job(folder, mem: str, mib: int):
    """A batch script that asks for ``mem`` and allocates ``mib`` MiB, touching every page."""
    script = folder / f"alloc{mib}.sh"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --mem={mem}\n#SBATCH --output={folder}/alloc{mib}-%j.out\n"
        f"python3 -c 'b = bytearray({mib} * 2**20); print(\"allocated {mib} MiB\")'\n"
    )
    return script


@pytest.mark.skipif(not cgroups.available(), reason="needs the cgroup v1 memory controller")
def test_job_past_its_memory_is_killed_alone(cluster, tmp_path):
    outside = "b = bytearray(300 * 2**20); import time; time.sleep(120)"  # bigger than the job's limit
    sentinel = subprocess.Popen([sys.executable, "-c", outside])
    try:
        job = jobs.submit(memory_job(tmp_path, "200M", 400))
        with pytest.raises(JobFailed) as failed:
            jobs.wait(job, timeout=120)
        message = str(failed.value)
        assert "ended OUT_OF_MEMORY" in message
        assert "oom-kill event" in message and "--mem" in message
        assert "allocated 400 MiB" not in job.log_path.read_text().splitlines()
        assert finished(cluster, str(job.id), str(job.id))[0] == "OUT_OF_MEMORY"
        assert sentinel.poll() is None  # the process outside the job is untouched
    finally:
        sentinel.kill()
    after = jobs.run(memory_job(tmp_path, "600M", 400), timeout=120)  # the next job runs normally
    assert after.state == "COMPLETED" and "allocated 400 MiB" in after.log_path.read_text().splitlines()


@pytest.mark.skipif(not cgroups.available(), reason="needs the cgroup v1 memory controller")
def test_a_job_finds_its_own_memory_cgroup(cluster, tmp_path):
    script = tmp_path / "cgroup.sh"  # the path in /proc/self/cgroup leads to the job's limit
    script.write_text(
        f"#!/bin/bash\n#SBATCH --mem=300M\n#SBATCH --output={tmp_path}/cgroup-%j.out\n"
        "own=$(awk -F: '$2 == \"memory\" {print $3}' /proc/self/cgroup)\n"
        'echo "$own"; cat "/sys/fs/cgroup/memory${own%/step_*}/memory.limit_in_bytes"\n'
    )
    job = jobs.run(script, timeout=60)
    own, limit = job.log_path.read_text().split()
    assert own == f"/slurm_{job.nodes}/uid_0/job_{job.id}/step_batch/task_0" and int(limit) == 300 * 2**20


def test_memory_beyond_a_node_is_refused_at_submission(cluster, tmp_path):
    with pytest.raises(JobError, match="sbatch refused"):
        jobs.submit(memory_job(tmp_path, f"{node_memory_mb() + 1024}M", 1))


def test_without_cgroups_slurm_kills_the_job_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "available", lambda: False)  # a machine without cgroup v1 memory
    paths = private_paths(tmp_path / "c")
    monkeypatch.setenv("LAB_CLUSTER_DIR", str(paths.root))
    monkeypatch.setenv("SLURM_CONF", str(paths.conf))
    try:
        daemons.start(paths)
        script = tmp_path / "hold.sh"  # JobAcctGatherParams=OverMemoryKill samples every second
        script.write_text(
            f"#!/bin/bash\n#SBATCH --mem=100M\n#SBATCH --output={tmp_path}/hold-%j.out\n"
            "python3 -c 'import time; b = bytearray(300 * 2**20); time.sleep(30)'\n"
        )
        with pytest.raises(JobFailed, match=r"(?s)ended FAILED.*exceeded memory limit"):
            jobs.run(script, timeout=60)
    finally:
        daemons.stop(paths)
