"""A workshop's cluster (issue 22, parts 2-4): two learners and an instructor, made by
``distlab.cluster.workshop`` as ``./lab workshop`` makes them, on a private cluster in workshop mode
(limits enforced, ``PrivateData=jobs``). Each test tries a forbidden thing as a real user and
asserts the refusal; the instructor is an ordinary Linux user, a Slurm operator. The accounts are
deleted at the end. Helpers and the folder open to all come from test_cluster_users.
"""

from __future__ import annotations

import os
import pwd
import re
import sys
from pathlib import Path

import pytest

from distlab import progress
from distlab.cluster import daemons, users, workshop
from tests import test_cluster_users as users_test
from tests.test_cluster_users import private_cluster, slurm, state, wait_until

shared, checkout = users_test.shared, users_test.checkout  # the same fixtures

pytestmark = [pytest.mark.timeout(180), pytest.mark.mostly_waits]
PLAN = workshop.Plan(2, prefix="isotest", instructor="isoteach")
ONE, TWO = PLAN.names
SLEEP = ("sbatch", "--parsable", "--job-name=sleeper", "--output=/dev/null", "--wrap=sleep 300")


@pytest.fixture(scope="module")
def cluster(shared):
    with private_cluster(shared / "cluster", prepare=workshop.enable_limits) as paths:
        yield paths


@pytest.fixture(scope="module")
def people(cluster, checkout):
    for name in (*PLAN.names, PLAN.instructor):
        if users.lookup(name) is not None and pwd.getpwnam(name).pw_gecos != users.COMMENT:
            pytest.skip(f"a user {name} exists and is not one the lab made: not touching it")
    workshop.ensure_accounts(cluster, PLAN, checkout)
    yield {name: users.lookup(name) for name in (*PLAN.names, PLAN.instructor)}
    try:
        slurm(cluster, None, "scancel", "-u", ",".join(PLAN.names))
    finally:
        for name in (*PLAN.names, PLAN.instructor):
            users.remove(name, cluster)


def submit(cluster, who: users.Learner, *options: str, running: bool = True) -> str:
    out = slurm(cluster, who, *SLEEP[:2], *options, *SLEEP[2:])
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip()
    if running:
        wait_until(lambda: state(cluster, job) == "RUNNING", 30)
    return job


def test_learner_cannot_cancel_hold_or_change_anothers_job(cluster, people):
    one, two = people[ONE], people[TWO]
    job = submit(cluster, one)
    limit = slurm(cluster, None, "squeue", "-h", "-j", job, "-o", "%l %p").stdout
    for cmd in (
        ["scancel", job],
        ["scontrol", "hold", job],
        ["scontrol", "update", f"JobId={job}", "TimeLimit=1"],
        ["scontrol", "requeue", job],
        ["scontrol", "suspend", job],
    ):
        out = slurm(cluster, two, *cmd)
        assert out.returncode != 0 and re.search(users_test.REFUSED, out.stderr), (cmd, out)
    assert state(cluster, job) == "RUNNING"
    assert slurm(cluster, None, "squeue", "-h", "-j", job, "-o", "%l %p").stdout == limit
    assert slurm(cluster, one, "scancel", job).returncode == 0


def test_learners_see_their_own_jobs_the_instructor_sees_and_cancels_all(cluster, people):
    one, two, teacher = people[ONE], people[TWO], people[PLAN.instructor]
    jobs = {ONE: submit(cluster, one), TWO: submit(cluster, two)}
    assert slurm(cluster, two, "squeue", "-h", "-o", "%i").stdout.split() == [jobs[TWO]]
    queue = slurm(cluster, teacher, "squeue", "-h", "-o", "%i %u").stdout.splitlines()
    assert {f"{jobs[n]} {n}" for n in jobs} <= set(queue)

    def accounted(who) -> set[str]:
        out = slurm(cluster, who, "sacct", "-a", "-X", "-n", "-P", "-o", "JobID,User")
        return set(out.stdout.split())

    wait_until(lambda: {f"{jobs[n]}|{n}" for n in jobs} <= accounted(teacher), 30)
    assert f"{jobs[ONE]}|{ONE}" not in accounted(two)  # sacct -a: the learner's own jobs only
    assert slurm(cluster, teacher, "scancel", *jobs.values()).returncode == 0
    wait_until(lambda: all(state(cluster, j) not in ("PENDING", "RUNNING") for j in jobs.values()), 30)


def test_a_runaway_learner_holds_at_most_half_the_cluster(cluster, people):
    one, two = people[ONE], people[TWO]
    big = submit(cluster, one, "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=32")
    more = submit(cluster, one, "--ntasks=1", running=False)

    def reason() -> str:
        return slurm(cluster, None, "squeue", "-h", "-j", more, "-o", "%T %r").stdout.strip()

    wait_until(lambda: reason() == "PENDING QOSMaxCpuPerUserLimit", 30)
    other = submit(cluster, two, "--ntasks=1")  # the rest of the class still runs
    assert slurm(cluster, None, "scancel", big, more, other).returncode == 0


def test_no_one_reads_a_learners_work_nor_the_clusters_secrets(cluster, people):
    one = people[ONE]
    folder = one.workspace / "notebooks"
    script = "mkdir -p jobs && echo 'sleep 1' > jobs/run.sbatch && touch jobs/run.out jobs/checkpoint.pt"
    assert one.run(["sh", "-c", script], cwd=folder).returncode == 0
    mine = [
        folder / "00_start_here.ipynb",
        *(folder / "jobs" / f for f in ("run.sbatch", "run.out", "checkpoint.pt")),
    ]
    secrets = [cluster.munge_key, cluster.root / "slurmdbd.conf", cluster.root / "mysql" / "slurm.pass"]
    for who in (people[TWO], people[PLAN.instructor]):
        for path in mine + secrets:
            out = who.run(["cat", str(path)])
            assert out.returncode != 0 and "Permission denied" in out.stderr, (who.name, path)


def test_progress_is_recorded_for_the_instructor_alone(cluster, people):
    one, two, teacher = people[ONE], people[TWO], people[PLAN.instructor]
    python, code = Path(sys.executable), Path(progress.__file__).parents[1]
    for path in (python, code):
        if daemons.closed_folder(path):
            pytest.skip(f"{daemons.closed_folder(path)} is closed to other users: learners cannot run {path}")
    folder = workshop.progress_folder(cluster)
    env = {"LAB_PROGRESS_DIR": str(folder), "PYTHONPATH": str(code)}
    answers = "from distlab.checks import check\ncheck('world size', 4, expected=4)\ncheck('ranks', 'FIXME', expected=1)"
    out = one.run([str(python), "-c", answers], env=one.env(**env))
    assert out.returncode == 0, out.stderr
    assert two.run(["cat", str(folder / f"{ONE}.jsonl")]).returncode != 0
    assert "Permission denied" in two.run(["ls", str(folder)]).stderr
    forged = '{"user": "isoteach", "notebook": "", "exercise": "world size", "result": "ok", "time": "9"}\n'
    assert two.run(["sh", "-c", f"cat > {folder}/isoteach.jsonl"], input=forged).returncode == 0
    report = teacher.run(
        [str(python), "-m", "distlab.progress", "--folder", str(folder)], env=teacher.env(**env)
    )
    assert report.returncode == 0, report.stderr
    assert f"{ONE}   +  .   1/2" in report.stdout and "isoteach" not in report.stdout.split("\n\n")[0]
    refused = two.run([str(python), "-m", "distlab.progress", "--folder", str(folder)], env=two.env(**env))
    assert refused.returncode == 1 and "Permission denied" in refused.stdout
    assert os.stat(folder / f"{ONE}.jsonl").st_mode & 0o777 == progress.FILE_MODE
