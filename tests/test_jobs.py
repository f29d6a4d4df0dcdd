"""The local cluster runs real jobs, and the job helpers report what happened to them."""

from __future__ import annotations

import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from distlab import jobs

# Slurm's behaviour with jobs that sleep, hold or pend: little CPU, much waiting (up to 30 s for
# Slurm's time-limit check in one test)
pytestmark = [pytest.mark.timeout(240), pytest.mark.mostly_waits]


def write_job(folder: Path, name: str, body: str, *sbatch: str) -> Path:
    header = [f"#SBATCH --job-name={name}", f"#SBATCH --output={folder}/%x-%j.out", *sbatch]
    script = folder / f"{name}.sbatch"
    script.write_text(
        "#!/bin/bash\n" + "\n".join(header) + "\n"
        'source "$LAB_ROOT/sites/job-env.sh"\n' + textwrap.dedent(body)
    )
    return script


def test_two_node_job_runs_on_both_nodes(slurm_cluster, tmp_path):
    script = write_job(
        tmp_path, "two-nodes", "srun hostname\n", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1"
    )
    job = jobs.run(script, timeout=120)
    assert job.state == "COMPLETED"
    assert sorted(line.strip() for line in job.grep(r"^node\d$")) == ["node1", "node2"]
    assert job.grep(r"site=local backend=gloo procs/node=2 master=node1:")


def test_srun_torchrun_rendezvous_across_nodes(slurm_cluster, tmp_path):
    """The launch line every notebook uses: 2 nodes x 2 processes meet through c10d."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        textwrap.dedent("""
        import socket, torch.distributed as dist
        from distlab.distributed import init_distributed
        ctx = init_distributed()
        names = [None] * ctx.world_size
        dist.all_gather_object(names, socket.gethostname())
        print(f"rank {ctx.rank}/{ctx.world_size} on {socket.gethostname()} backend {ctx.backend} sees {names}")
        dist.destroy_process_group()
    """)
    )
    script = write_job(
        tmp_path,
        "rdzv",
        f"""
        srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=$LAB_PROCS_PER_NODE \\
            --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT {probe}
    """,
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
    )
    job = jobs.run(script, timeout=180)
    lines = job.grep(r"^rank \d/4")
    assert len(lines) == 4
    assert all("['node1', 'node1', 'node2', 'node2']" in line for line in lines)


def test_gres_request_is_granted_and_bounded(slurm_cluster, tmp_path):
    script = write_job(
        tmp_path,
        "gres",
        'echo "gpus=$CUDA_VISIBLE_DEVICES"\n',
        "#SBATCH --gpus-per-node=2",
        "#SBATCH --cpus-per-task=32",
    )
    job = jobs.run(script, timeout=60)
    assert job.grep(r"^gpus=0,1$")
    with pytest.raises(jobs.JobError, match="sbatch refused"):
        jobs.submit(script, "--gpus-per-node=3")


def test_failing_job_shows_its_own_error(slurm_cluster, tmp_path):
    script = write_job(tmp_path, "fails", "python -c \"raise ValueError('bad learning rate -1')\"\n")
    with pytest.raises(jobs.JobFailed) as err:
        jobs.run(script, timeout=60)
    assert err.value.job.state == "FAILED"
    assert "ValueError: bad learning rate -1" in str(err.value)
    assert "exit code 1:0" in str(err.value)


def test_sbatch_error_is_shown(slurm_cluster, tmp_path):
    script = write_job(tmp_path, "bad-option", "true\n", "#SBATCH --nodes=7")
    with pytest.raises(jobs.JobError, match="Node count specification invalid"):
        jobs.submit(script)


def test_timed_out_job_is_reported_as_timeout(slurm_cluster, tmp_path):
    """A job that reaches its time limit ends TIMEOUT, reported with Slurm's line and its own.

    Slurm counts limits in whole minutes and looks for jobs past theirs every 30 s, so a job given
    the shortest limit runs 60 to 90 s. Instead, once the job runs, its limit is lowered to zero
    (``scontrol update TimeLimit=0``, as a job's owner may), which moves its end time to now: Slurm
    ends it for its time limit at its next look, within 30 s.
    """
    script = write_job(tmp_path, "too-long", "echo started; sleep 600\n")
    # On the command line: it beats the site profile's SBATCH_TIMELIMIT, which beats #SBATCH lines.
    job = jobs.submit(script, "--time=00:01:00")
    assert job.info["TimeLimit"] == "00:01:00", job.info
    deadline = time.monotonic() + 60
    while not job.grep("^started$"):
        assert time.monotonic() < deadline, f"job {job.id} never started: {jobs.refresh(job).state}"
        time.sleep(0.2)
    lowered = subprocess.run(
        ["scontrol", "update", f"JobId={job.id}", "TimeLimit=0"], capture_output=True, text=True, timeout=30
    )
    assert lowered.returncode == 0, lowered.stderr
    with pytest.raises(jobs.JobFailed) as err:
        jobs.wait(job, timeout=90)
    assert err.value.job.state == "TIMEOUT"
    assert "time limit" in str(err.value)
    assert "started" in str(err.value)  # the log tail comes with it


def test_wait_has_a_timeout_and_cancels(slurm_cluster, tmp_path):
    script = write_job(tmp_path, "waits", "sleep 600\n")
    job = jobs.submit(script)
    with pytest.raises(jobs.JobTimeout, match="of running .* cancelled it"):
        jobs.wait(job, timeout=1)
    assert jobs.wait(job, timeout=60, check=False).state == "CANCELLED"


def release_later(job_id: int, seconds: float) -> threading.Timer:
    """``scontrol release`` the held job after ``seconds``, as an operator (or the user) would."""
    timer = threading.Timer(seconds, subprocess.run, [["scontrol", "release", str(job_id)]])
    timer.start()
    return timer


def test_held_job_is_waited_for_not_cancelled(slurm_cluster, tmp_path, capsys):
    """Queue time does not count against ``timeout``; the pending reason is shown while it waits."""
    script = write_job(tmp_path, "held", "echo ran\n")
    job = jobs.submit(script, "--hold")
    timer = release_later(job.id, 6)
    try:
        jobs.wait(job, timeout=3, pending_timeout=120)  # 3 s of running, after 6 s held
    finally:
        timer.cancel()
    assert job.state == "COMPLETED" and job.grep("^ran$")
    assert job.pending_s >= 5, job.pending_s
    shown = capsys.readouterr().out
    assert f"job {job.id} held.sbatch: PENDING" in shown and "(JobHeldUser)" in shown, shown


def test_dependency_is_waited_for(slurm_cluster, tmp_path, capsys):
    first = jobs.submit(write_job(tmp_path, "first", "sleep 2\n"))
    second = jobs.submit(write_job(tmp_path, "second", "echo after\n"), f"--dependency=afterok:{first.id}")
    jobs.wait(second, timeout=30, pending_timeout=120)
    assert second.grep("^after$") and "(Dependency)" in capsys.readouterr().out


def test_pending_has_its_own_limit(slurm_cluster, tmp_path):
    job = jobs.submit(write_job(tmp_path, "stays-held", "true\n"), "--hold")
    with pytest.raises(jobs.JobTimeout, match=r"still PENDING \(JobHeldUser\) after \d+ s in the queue"):
        jobs.wait(job, timeout=600, pending_timeout=1)
    assert jobs.wait(job, timeout=30, check=False).state == "CANCELLED"


def test_request_that_can_never_run_is_cancelled_with_the_reason(slurm_cluster, tmp_path):
    failed = jobs.run(write_job(tmp_path, "fails-first", "exit 3\n"), timeout=60, check=False)
    assert failed.state == "FAILED"
    orphan = jobs.submit(write_job(tmp_path, "orphan", "true\n"), f"--dependency=afterok:{failed.id}")
    with pytest.raises(jobs.JobError, match="can never start: Slurm says DependencyNeverSatisfied"):
        jobs.wait(orphan, timeout=60, pending_timeout=120)
    assert jobs.wait(orphan, timeout=30, check=False).state == "CANCELLED"


def test_cpus_per_task_reach_every_step(slurm_cluster, tmp_path):
    """Since Slurm 22.05 srun does not inherit --cpus-per-task: job-env.sh passes it on."""
    body = """
        echo "batch OMP_NUM_THREADS=$OMP_NUM_THREADS SRUN_CPUS_PER_TASK=$SRUN_CPUS_PER_TASK"
        srun bash -c 'echo "step $SLURM_PROCID cpus=$SLURM_CPUS_PER_TASK omp=$OMP_NUM_THREADS"'
    """
    job = jobs.run(
        write_job(tmp_path, "cpus", body, "#SBATCH --nodes=2", "#SBATCH --cpus-per-task=3"), timeout=60
    )
    assert job.grep(r"^batch OMP_NUM_THREADS=3 SRUN_CPUS_PER_TASK=3$")
    assert sorted(job.grep(r"^step ")) == ["step 0 cpus=3 omp=3", "step 1 cpus=3 omp=3"]
    assert job.grep(r" cpus/task=3$")


def test_no_cpu_request_keeps_slurms_default(slurm_cluster, tmp_path):
    """The profile's SRUN_CPUS_PER_TASK (for interactive srun) must not reach a job that asked for none."""
    body = 'echo "srun_cpus=${SRUN_CPUS_PER_TASK:-unset} omp=${OMP_NUM_THREADS:-unset}"\n'
    job = jobs.run(write_job(tmp_path, "no-cpus", body), timeout=60)
    assert job.grep(r"^srun_cpus=unset omp=unset$") and job.grep(r" cpus/task=default$")
