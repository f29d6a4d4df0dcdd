"""Faults put into a running Slurm job on purpose, and the checkpoint interval that pays (notebook 10).

A rank of a running job is found and signalled from inside the job's allocation, as on any
cluster: a step that overlaps the job (``srun --jobid=J --overlap``) runs
``python -m distlab.fault_agent`` on its nodes, which finds the rank's process and signals it
(see that module). From Python: :func:`rank_pids`, :func:`inject` and :func:`kill_node`.

How often to checkpoint (Young 1974, Daly 2006), for a save that takes C seconds and a mean time
between failures M: a failure loses on average half an interval plus the restart R, a save costs C
every interval tau, so the expected fraction of time lost is about

    C / tau + (tau / 2 + R) / M,   smallest at   tau = sqrt(2 C M)   (Young; Daly adds - C for C << M)
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

from distlab.fault_agent import last_iteration
from distlab.jobs import refresh
from distlab.slurm_job import FINAL_STATES, Job


def young_daly_interval(save_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval sqrt(2 C M), in seconds (the time between saves)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's first-order refinement, sqrt(2 C M) - C (for C < M / 2; else M)."""
    return young_daly_interval(save_s, mtbf_s) - save_s if save_s < mtbf_s / 2 else mtbf_s


def lost_fraction(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected fraction of time lost to saves and failures: C / tau + (tau / 2 + R) / M."""
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def job_mtbf_s(per_device_mtbf_s: float, devices: int) -> float:
    """Independent failures: a job of N devices fails N times as often as one device."""
    return per_device_mtbf_s / devices


def _step_env() -> dict[str, str]:
    """This environment without the site's GPU request for steps (``SLURM_GPUS_PER_NODE``): a step
    into a job that asked for no GPUs must ask for none, and one that did gets the job's anyway."""
    return {k: v for k, v in os.environ.items() if k != "SLURM_GPUS_PER_NODE"}


def _overlap(job: Job, *command: str) -> list[str]:
    """srun one task per node of ``job``, inside its allocation."""
    nodes = int(refresh(job).info.get("NumNodes", "1").split("-")[0])
    return ["srun", f"--jobid={job.id}", "--overlap", f"-N{nodes}", f"-n{nodes}", "--ntasks-per-node=1",
            "--cpus-per-task=1", *command]  # fmt: skip


def rank_pids(job: Job, expected: int | None = None, timeout: float = 60) -> dict[int, tuple[str, int]]:
    """rank -> (node, pid) of the job's training processes, asked on every node of the job; with
    ``expected``, asked again until that many ranks are found (a loaded node may list a worker
    before its environment is readable), else a RuntimeError naming the ranks found."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(
            _overlap(job, sys.executable, "-m", "distlab.fault_agent", "pids", "--job", str(job.id)),
            capture_output=True, text=True, timeout=timeout, env=_step_env(),
        )  # fmt: skip
        if out.returncode:
            raise RuntimeError(f"srun --overlap into job {job.id} failed: {out.stderr.strip()}")
        found = {}
        for line in out.stdout.splitlines():
            node, rank, pid = line.split()
            found[int(rank)] = (node, int(pid))
        if expected is None or len(found) >= expected:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"job {job.id}: found ranks {sorted(found)} of {expected} after {timeout:.0f} s"
            )
        time.sleep(0.5)


def kill_node(
    job: Job, node: str | None = None, sig: str = "KILL", after_iteration: int = 0
) -> subprocess.Popen:
    """Start a step in ``job`` on ``node`` (default: the job's last node) that, once the log shows
    ``after_iteration`` (at once without it), signals every process of the job there, as the node's
    loss would end them: its ``torchrun`` agent and that agent's workers at once. Returns it running
    (``.communicate()`` gives the line of what was killed), so that two jobs' losses can be armed
    before either happens. The first node runs the batch script (and here the rendezvous store):
    losing it ends the job whatever torchrun does."""
    wait_for_state(job, {"RUNNING"})
    if node is None:
        listed = subprocess.run(["scontrol", "show", "hostnames", refresh(job).nodes], capture_output=True,
                                text=True, check=True)  # fmt: skip
        node = listed.stdout.split()[-1]
    return subprocess.Popen(
        ["srun", f"--jobid={job.id}", "--overlap", "-N1", "-n1", f"--nodelist={node}", "--cpus-per-task=1",
         sys.executable, "-m", "distlab.fault_agent", "kill-node", "--job", str(job.id), "--signal", sig,
         "--after-iteration", str(after_iteration), "--log", str(job.log_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_step_env(),
    )  # fmt: skip


def inject(job: Job, rank: int, sig: str = "KILL", after_iteration: int = 0) -> subprocess.Popen:
    """Start a step in ``job`` that sends ``sig`` to ``rank`` once the log shows ``after_iteration``
    (every rank runs by then; without it, at once); returns it running (``.communicate()`` gives the
    line of the node that sent it)."""
    wait_for_state(job, {"RUNNING"})
    cmd = [sys.executable, "-m", "distlab.fault_agent", "signal", "--job", str(job.id), "--rank", str(rank),
           "--signal", sig]  # fmt: skip
    if after_iteration:
        cmd += ["--after-iteration", str(after_iteration), "--log", str(job.log_path)]
    return subprocess.Popen(
        _overlap(job, *cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_step_env()
    )


def throttle(job: Job, rank: int, share: float = 0.5, after_iteration: int = 0) -> subprocess.Popen:
    """Start a step in ``job`` that makes ``rank`` a straggler once the log shows ``after_iteration``:
    stopped ``share`` of every 200 ms until it ends (``fault_agent throttle``); returns it running."""
    wait_for_state(job, {"RUNNING"})
    cmd = [sys.executable, "-m", "distlab.fault_agent", "throttle", "--job", str(job.id), "--rank", str(rank),
           "--share", str(share)]  # fmt: skip
    if after_iteration:
        cmd += ["--after-iteration", str(after_iteration), "--log", str(job.log_path)]
    return subprocess.Popen(
        _overlap(job, *cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_step_env()
    )


def wait_for_state(job: Job, states: set[str], timeout: float = 300, reason: str | None = None) -> Job:
    """Poll until the job is in one of ``states`` (and, when given, pends for ``reason``)."""
    deadline = time.monotonic() + timeout
    while True:
        state = refresh(job).state.split()[0]
        if state in states and (reason is None or job.reason == reason):
            return job
        if state in FINAL_STATES - states:
            raise RuntimeError(f"job {job.id} ended {state} while waiting for {sorted(states)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job.id} still {state} ({job.reason}) after {timeout:.0f} s")
        time.sleep(0.2)


def wait_for_iteration(job: Job, iteration: int, timeout: float = 300) -> int:
    """Poll the job's log until it shows ``iteration``; return the last iteration seen."""
    deadline = time.monotonic() + timeout
    while True:
        seen = last_iteration(job.log())
        if seen >= iteration:
            return seen
        if refresh(job).state.split()[0] in FINAL_STATES or time.monotonic() > deadline:
            raise RuntimeError(f"job {job.id} is {job.state} and its log stops at iteration {seen}")
        time.sleep(0.05)


def wait_for_attempt(job: Job, number: int, timeout: float = 300, since: float | None = None) -> float:
    """Poll until the ``number``-th training attempt in the job's log has logged an iteration; return
    the seconds from ``since`` (a ``time.monotonic()`` taken at the kill; default: this call) to
    when the poll first saw it (within 0.05 s). Timed from the kill, and called at once after it
    (the log has no clock: an attempt already logged when the poll starts is timed to the poll), that
    is the **restart cost** R: the failure noticed, the agents' new rendezvous, fresh processes
    (imports, process groups, the checkpoint loaded) and one iteration."""
    from distlab.logs.restarts import attempts

    start = time.monotonic()
    since = start if since is None else since
    deadline = start + timeout
    while True:
        runs = attempts(job.log())
        if len(runs) >= number and runs[number - 1].losses:
            return time.monotonic() - since
        if refresh(job).state.split()[0] in FINAL_STATES or time.monotonic() > deadline:
            raise RuntimeError(
                f"job {job.id} is {job.state} and its log shows {len(runs)} attempt(s), not {number}"
            )
        time.sleep(0.05)
