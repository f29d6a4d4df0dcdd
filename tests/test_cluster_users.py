"""Learners on a private cluster (issue 22): two throwaway users, ``labtest1`` and ``labtest2``,
made by ``distlab.cluster.users`` as ``./lab up`` makes a learner, submit jobs as themselves. Each
test tries a forbidden thing as the other user and asserts the refusal; root, the instructor, sees
and cancels every job. The users are deleted at the end.

The cluster lives in a folder of /tmp open to all (pytest's own folders are 0700: no user could
reach its munge socket), on free ports, beside the main cluster. So does a copy of the notebooks
that the workspaces are made from, wherever this checkout lies (CI's may be in a closed folder).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from distlab.cluster import ClusterPaths, accounting, config, daemons, process, users
from distlab.local_ranks import free_port

pytestmark = [pytest.mark.timeout(180), pytest.mark.mostly_waits]
NAMES = ("labtest1", "labtest2")
REFUSED = r"Access/permission denied|Invalid user id"  # scancel's words; scontrol's for another's job
PENDING_OR_RUNNING = ("PENDING", "RUNNING")


def free_base() -> int:
    base = free_port()
    while any(process.port_busy(base + i) for i in range(5)):
        base = free_port()
    return base


@pytest.fixture(scope="module")
def shared():
    """A folder of /tmp that every user may pass through (removed at the end)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: it makes two users and runs a private cluster")
    try:
        daemons._check_prerequisites()
    except daemons.ClusterError as e:
        pytest.skip(str(e))
    root = Path(tempfile.mkdtemp(prefix="distlab-users-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def private_cluster(folder: Path, prepare: Callable[[ClusterPaths], object] = lambda paths: None):
    """A cluster in ``folder`` on free ports (``prepare(paths)`` before it starts), stopped after."""
    paths = ClusterPaths(root=folder, port_base=free_base())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAB_CLUSTER_DIR", str(paths.root))
        mp.delenv("LAB_CLUSTER_PORT", raising=False)  # its own ports: read from its folder, not another's
        try:
            prepare(paths)
            daemons.start(paths)
            yield paths
        finally:
            daemons.stop(paths)


@pytest.fixture(scope="module")
def cluster(shared):
    with private_cluster(shared / "cluster") as paths:
        yield paths


@pytest.fixture(scope="module")
def checkout(shared) -> Path:
    """What a workspace is made from: the notebooks and solutions, readable by all."""
    copy = shared / "checkout"
    for folder in (*users.COPIED, *users.LINKED):
        (copy / folder).mkdir(parents=True)
    for folder in users.COPIED:
        for notebook in (users.CHECKOUT / folder).glob("*.ipynb"):
            shutil.copy(notebook, copy / folder)
    for path in [copy, *copy.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return copy


@pytest.fixture(scope="module")
def learners(cluster, checkout):
    for name in NAMES:
        if users.lookup(name) is not None and pwd.getpwnam(name).pw_gecos != users.COMMENT:
            pytest.skip(f"a user {name} exists and is not one the lab made: not touching it")
    made = {name: users.ensure(name, cluster, checkout) for name in NAMES}
    yield made
    try:
        for name in NAMES:
            slurm(cluster, None, "scancel", "-u", name)
        everyone = ",".join(NAMES)
        wait_until(lambda: not slurm(cluster, None, "squeue", "-h", "-u", everyone).stdout.strip(), 30)
    finally:
        for name in NAMES:
            users.remove(name, cluster)


def slurm(paths: ClusterPaths, user: users.Learner | None, *cmd: str, cwd: Path | None = None):
    """A Slurm command as ``user`` (root, the instructor, when None) against the private cluster."""
    if user is None:
        env = {**os.environ, "SLURM_CONF": str(paths.conf)}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=cwd)
    return user.run(list(cmd), env=user.env(SLURM_CONF=str(paths.conf)), cwd=cwd)


def wait_until(ok, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s")
        time.sleep(0.1)


def sleeper(paths: ClusterPaths, user: users.Learner) -> str:
    """A job of ``user`` that runs (sleeps) until cancelled; its id once it runs."""
    out = slurm(
        paths, user, "sbatch", "--parsable", "--job-name=sleeper", "--output=/dev/null", "--wrap=sleep 300"
    )
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip()
    wait_until(lambda: state(paths, job) == "RUNNING", 30)
    return job


def state(paths: ClusterPaths, job: str) -> str:
    return slurm(paths, None, "squeue", "-h", "-j", job, "-o", "%T").stdout.strip()


@pytest.fixture(scope="module")
def finished_job(cluster, learners):
    """labtest1's two-node batch job, written and submitted from its notebooks folder as a notebook
    does: (job id, script, log)."""
    one = learners["labtest1"]
    folder = one.workspace / "notebooks"
    script = folder / "jobs" / "whoami.sbatch"
    text = (
        "#!/bin/bash\n#SBATCH --job-name=whoami\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n"
        "#SBATCH --output=jobs/%x-%j.out\n#SBATCH --time=00:02:00\n"
        "srun bash -c 'echo \"$(hostname) $(id -un) $PWD\"'\n"
        "touch jobs/checkpoint.pt\n"
    )
    assert one.run(["sh", "-c", f"mkdir -p jobs && cat > {script}"], cwd=folder, input=text).returncode == 0
    out = slurm(cluster, one, "sbatch", "--parsable", "--wait", str(script), cwd=folder)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip()
    return job, script, folder / "jobs" / f"whoami-{job}.out"


def test_a_private_cluster_never_takes_the_default_ports(tmp_path, monkeypatch):
    monkeypatch.delenv("LAB_CLUSTER_PORT", raising=False)
    monkeypatch.setenv("LAB_CLUSTER_DIR", str(tmp_path / "cluster"))
    paths = config.local_paths()
    assert not set(paths.ports()) & set(ClusterPaths(tmp_path).ports()), paths  # the default's
    assert paths == config.local_paths()  # the same in every process
    monkeypatch.setenv("LAB_CLUSTER_DIR", str(tmp_path / "other"))
    assert config.local_paths().port_base != paths.port_base
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / config.PORT_FILE).write_text("23005\n")  # what its cluster was started on
    assert config.local_paths().port_base == 23005
    monkeypatch.setenv("LAB_CLUSTER_PORT", "24000")
    assert config.local_paths().port_base == 24000


def test_the_cluster_records_its_ports(cluster):
    assert (cluster.root / config.PORT_FILE).read_text() == f"{cluster.port_base}\n"
    assert config.local_paths() == cluster  # LAB_CLUSTER_DIR alone names it, ports and all


def test_learners_job_runs_on_both_nodes_as_the_learner(cluster, learners, finished_job):
    job, script, log = finished_job
    folder = script.parent.parent
    assert sorted(log.read_text().splitlines()) == [f"node1 labtest1 {folder}", f"node2 labtest1 {folder}"]
    assert log.stat().st_uid == learners["labtest1"].uid
    assert oct(log.stat().st_mode & 0o777) == "0o600"  # the learner's umask 077 goes with the job

    def recorded() -> bool:
        out = slurm(
            cluster, learners["labtest1"], "sacct", "-j", job, "-X", "-n", "-P", "-o", "User,Account,State"
        )
        return out.stdout.strip() == f"labtest1|{accounting.LEARNERS_ACCOUNT}|COMPLETED"

    wait_until(recorded, 30)  # in accounting under the learner's name and account
    srun = slurm(cluster, learners["labtest2"], "srun", "-N2", "sh", "-c", "echo $(hostname) $(id -un)")
    assert srun.returncode == 0, srun.stderr
    assert sorted(srun.stdout.splitlines()) == ["node1 labtest2", "node2 labtest2"]


def test_learner_cannot_cancel_hold_or_change_anothers_job(cluster, learners):
    one, two = learners["labtest1"], learners["labtest2"]
    job = sleeper(cluster, one)
    limit = slurm(cluster, None, "squeue", "-h", "-j", job, "-o", "%l").stdout
    for cmd in (
        ["scancel", job],
        ["scancel", "-u", "labtest1"],
        ["scontrol", "hold", job],
        ["scontrol", "update", f"JobId={job}", "TimeLimit=1"],
        ["scontrol", "suspend", job],
        ["scontrol", "requeue", job],
    ):
        out = slurm(cluster, two, *cmd)
        assert out.returncode != 0, cmd
        assert re.search(REFUSED, out.stderr), (cmd, out.stderr)
    assert state(cluster, job) == "RUNNING"
    assert slurm(cluster, None, "squeue", "-h", "-j", job, "-o", "%l").stdout == limit
    # its script through Slurm: refused too (scontrol exits 0 here, so the words are what counts)
    out = slurm(cluster, two, "scontrol", "write", "batch_script", job, "-")
    assert "Invalid user id" in out.stderr + out.stdout and "sleep 300" not in out.stdout
    assert "sleep 300" in slurm(cluster, one, "scontrol", "write", "batch_script", job, "-").stdout


def test_learner_lists_the_pids_of_and_requeues_their_own_job(cluster, learners):
    """What notebook 10 does as the learner: its job's processes from inside the allocation, a requeue."""
    one = learners["labtest1"]
    job = sleeper(cluster, one)
    pids = slurm(cluster, one, "srun", f"--jobid={job}", "--overlap", "-N1", "scontrol", "listpids", job)
    assert pids.returncode == 0 and re.search(rf"^\d+ +{job} ", pids.stdout, re.MULTILINE), (
        pids.stdout,
        pids.stderr,
    )
    requeue = slurm(cluster, one, "scontrol", "requeue", job)
    assert requeue.returncode == 0, requeue.stderr
    shown = slurm(cluster, None, "scontrol", "show", "job", job).stdout
    assert "Restarts=1" in shown, shown
    assert slurm(cluster, one, "scancel", job).returncode == 0


def test_scancel_u_user_cancels_only_ones_own_jobs(cluster, learners):
    one, two = learners["labtest1"], learners["labtest2"]
    theirs, mine = sleeper(cluster, one), sleeper(cluster, two)
    assert slurm(cluster, two, "scancel", "-u", "labtest2").returncode == 0
    wait_until(lambda: state(cluster, mine) not in PENDING_OR_RUNNING, 30)
    assert state(cluster, theirs) == "RUNNING"
    assert slurm(cluster, one, "scancel", theirs).returncode == 0  # its owner may


def test_learner_cannot_read_anothers_files(learners, finished_job):
    one, two = learners["labtest1"], learners["labtest2"]
    _, script, log = finished_job
    notebook = one.workspace / "notebooks" / "00_start_here.ipynb"
    checkpoint = script.parent / "checkpoint.pt"
    for path in (notebook, script, log, checkpoint):
        assert one.run(["cat", str(path)]).returncode == 0, path
        out = two.run(["cat", str(path)])
        assert out.returncode != 0 and "Permission denied" in out.stderr, path
    out = two.run(["ls", str(one.workspace)])
    assert "Permission denied" in out.stderr


def test_learner_cannot_read_the_munge_key_nor_the_database_password(cluster, learners):
    one = learners["labtest1"]
    secrets = (cluster.munge_key, cluster.root / "slurmdbd.conf", cluster.root / "mysql" / "slurm.pass")
    for path in secrets:
        out = one.run(["cat", str(path)])
        assert out.returncode != 0 and "Permission denied" in out.stderr, path
        assert (path.stat().st_uid, oct(path.stat().st_mode & 0o777)) == (0, "0o600"), path
    database = ["mariadb", "--no-defaults", "-h", "127.0.0.1", "-P", str(cluster.db_port), "-u", "root"]
    out = one.run([*database, "-e", "SELECT 1"])
    assert out.returncode != 0 and "Access denied" in out.stderr
    # ... while the munge socket is theirs to use, as Debian's munge socket is
    assert (
        one.run(
            ["sh", "-c", f"munge -n -S {cluster.munge_socket} | unmunge -S {cluster.munge_socket}"]
        ).returncode
        == 0
    )


def test_instructor_sees_and_cancels_every_job(cluster, learners):
    jobs = {name: sleeper(cluster, learners[name]) for name in NAMES}
    queue = slurm(cluster, None, "squeue", "-h", "-o", "%i %u").stdout.splitlines()
    assert {f"{jobs[n]} {n}" for n in NAMES} <= set(queue)

    def in_accounting() -> bool:  # records reach slurmdbd a moment after the job starts
        acct = slurm(cluster, None, "sacct", "-a", "-X", "-n", "-P", "-o", "JobID,User").stdout.split()
        return {f"{jobs[n]}|{n}" for n in NAMES} <= set(acct)

    wait_until(in_accounting, 30)
    assert slurm(cluster, None, "scancel", *jobs.values()).returncode == 0
    wait_until(lambda: all(state(cluster, j) not in PENDING_OR_RUNNING for j in jobs.values()), 30)


def test_workspace_is_the_learners_own_and_kept(cluster, checkout, learners):
    one = learners["labtest1"]
    ws = one.workspace
    assert (ws.stat().st_uid, oct(ws.stat().st_mode & 0o777)) == (one.uid, "0o700")
    assert (ws / "code").resolve() == checkout / "code"
    # the glossary every notebook links to, beside the learner's copies
    assert (ws / "notebooks" / "GLOSSARY.md").resolve() == checkout / "notebooks" / "GLOSSARY.md"
    assert sorted(p.name for p in (ws / "notebooks").glob("*.ipynb")) == sorted(
        p.name for p in (users.CHECKOUT / "notebooks").glob("*.ipynb")
    )
    copy = ws / "solutions" / "00_start_here_solution.ipynb"
    assert (
        one.run(
            ["sh", "-c", f"echo edited > {copy} && rm {ws}/notebooks/01_system_topology.ipynb"]
        ).returncode
        == 0
    )
    users.ensure("labtest1", cluster, checkout)  # again: keeps the edit, brings back the missing notebook
    assert copy.read_text() == "edited\n"
    assert (ws / "notebooks" / "01_system_topology.ipynb").exists()
    # ./lab test's workspace beside it: the checkout's notebooks anew each time, the edit left alone
    test_ws = users.prepare_workspace(one, checkout, folder=users.TEST_WORKSPACE)
    fresh = test_ws / "solutions" / copy.name
    assert one.run(["sh", "-c", f"echo edited > {fresh}"]).returncode == 0
    assert users.prepare_workspace(one, checkout, folder=users.TEST_WORKSPACE) == test_ws
    assert fresh.read_bytes() == (checkout / "solutions" / copy.name).read_bytes()
    assert (test_ws / ".venv").resolve() == checkout / ".venv" and copy.read_text() == "edited\n"
    assert (test_ws.stat().st_uid, oct(test_ws.stat().st_mode & 0o777)) == (one.uid, "0o700")
    assocs = slurm(
        cluster, None, "sacctmgr", "-n", "-P", "show", "assoc", "where", "user=labtest1", "format=account"
    )
    assert assocs.stdout.split() == [accounting.LEARNERS_ACCOUNT]
    # in the learner's JupyterLab, LAB_ROOT=workspace: data/ and runs/ are the learner's own
    code = "import distlab; print(distlab.REPO_ROOT)"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "LAB_ROOT": str(ws)}, capture_output=True
    )
    assert out.stdout.decode().strip() == str(ws)


def test_removing_a_throwaway_user_ends_their_processes_first(cluster, checkout):
    """``userdel`` refuses a user who still runs a process (a job step that outlives ``scancel``):
    ``users.remove`` gives their processes a grace period, then kills them, then deletes the user."""
    name = "labtest3"
    if users.lookup(name) is not None and pwd.getpwnam(name).pw_gecos != users.COMMENT:
        pytest.skip(f"a user {name} exists and is not one the lab made: not touching it")
    users.ensure(name, cluster, checkout)
    survivor = subprocess.Popen(
        ["runuser", "-u", name, "--", "sleep", "300"]
    )  # ignores no signal, never ends
    try:
        wait_until(lambda: subprocess.run(["pgrep", "-u", name], capture_output=True).returncode == 0, 10)
        started = time.monotonic()
        users.remove(name, cluster, grace_s=1.0)
        assert users.lookup(name) is None
        assert survivor.wait(timeout=10) != 0  # killed, not finished
        assert time.monotonic() - started < 15
    finally:
        survivor.kill()
        if users.lookup(name) is not None:
            users.remove(name, cluster)
