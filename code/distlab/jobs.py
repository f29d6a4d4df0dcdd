"""Job helpers for notebooks: submit an sbatch file, wait with a live view, read the log back.

Contract:
    * ``submit`` returns a :class:`Job` or raises :class:`JobError` carrying sbatch's own message;
    * ``wait`` polls until the job ends and counts its time in two parts: *pending* (queued for
      resources, priority, a dependency or a hold; its reason shown live) up to
      ``pending_timeout`` (default ``$LAB_PENDING_TIMEOUT`` or 3600 s), and *running* up to
      ``timeout``. Past either, the job is cancelled and :class:`JobTimeout` raised. A request
      that can never run (more nodes than the partition has, a time limit over its maximum, a
      dependency that can no longer be met) is cancelled at once, with Slurm's reason. A job that
      ends in any state but COMPLETED raises :class:`JobFailed` with the job's own error lines;
    * ``run`` is ``wait(submit(...))``.

The site profile (``distlab.site``) is applied at submission, so ``SBATCH_PARTITION`` and friends
override the script's ``#SBATCH`` lines.
"""

from __future__ import annotations

import getpass
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

from distlab import site
from distlab.cluster.config import local_paths
from distlab.slurm_job import (
    FINAL_STATES,
    HOPELESS_REASONS,
    WAITING_STATES,
    Job,
    JobError,
    JobFailed,
    JobTimeout,
)

DEFAULT_PENDING_TIMEOUT = 3600.0


def _slurm_env() -> dict[str, str]:
    env = {**os.environ, **site.profile_env()}
    conf = local_paths().conf
    if env.get("LAB_SITE") == "local" and "SLURM_CONF" not in os.environ and conf.exists():
        env["SLURM_CONF"] = str(conf)
    return env


def _slurm(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=_slurm_env(), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise JobError(f"{cmd[0]} not found: is Slurm installed here? (`./lab setup`)") from e
    except subprocess.TimeoutExpired as e:
        raise JobError(
            f"`{shlex.join(cmd)}` did not answer within {timeout:.0f} s: is slurmctld up? "
            "(`./lab cluster status`)"
        ) from e


def setup_notebook(folder: str | Path = "jobs") -> Path:
    """Prepare a notebook's session: job folder, site environment, and a look at the cluster.

    The site profile goes into this session's environment, so that ``!sbatch``, ``!srun`` and
    ``!salloc`` typed in a cell use the site's partition, account and QOS as ``jobs.submit`` does.
    """
    jobs_dir = Path(folder).resolve()
    jobs_dir.mkdir(parents=True, exist_ok=True)
    env = _slurm_env()
    os.environ.update(site.command_env(site.profile_env()))
    os.environ.setdefault("USER", getpass.getuser())  # `squeue -u $USER` in cells (containers lack it)
    if "SLURM_CONF" in env:
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]
    out = _slurm(["sinfo", "-h", "-o", "%P %a %D %T %N %G"])
    if out.returncode != 0:
        hint = "start it with `./lab cluster start`" if env["LAB_SITE"] == "local" else "check your site"
        raise JobError(f"the cluster does not answer (sinfo: {out.stderr.strip()}): {hint}")
    print(f"site: {env['LAB_SITE']}   jobs folder: {jobs_dir}")
    print("partition avail nodes state nodelist gres\n" + out.stdout.rstrip())
    if env["LAB_SITE"] == "local":
        print(
            "local cluster: 2 nodes on this machine; jobs run on the CPU with the gloo backend "
            "(gpu:2 per node is a scheduling token, not a GPU)"
        )
    return jobs_dir


def submit(script: str | Path, *sbatch_args: str) -> Job:
    """``sbatch --parsable [args] script``; raises JobError with sbatch's message on refusal."""
    script = Path(script)
    if not script.is_file():
        raise JobError(f"no such sbatch script: {script.resolve()}")
    out = _slurm(["sbatch", "--parsable", *sbatch_args, str(script)])
    if out.returncode != 0:
        raise JobError(f"sbatch refused {script}:\n{out.stderr.strip()}")
    job = Job(id=int(out.stdout.strip().split(";")[0]), script=script)
    return refresh(job)


def _parse_scontrol(text: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"(\w+(?:/\w+)?)=(\S*)", text))


def refresh(job: Job) -> Job:
    """Ask Slurm for the job's state (scontrol while it knows the job, then sacct)."""
    out = _slurm(["scontrol", "show", "job", "-o", str(job.id)])
    if out.returncode == 0 and out.stdout.strip():
        info = _parse_scontrol(out.stdout)
        job.info = info
        job.state = info.get("JobState", job.state)
        job.elapsed = info.get("RunTime", job.elapsed)
        job.exit_code = info.get("ExitCode", job.exit_code)
        job.nodes = info.get("NodeList", job.nodes) if info.get("NodeList") != "(null)" else ""
        job.reason = info.get("Reason", "")
        if info.get("StdOut"):
            job.log_path = Path(info["StdOut"])
        return job
    acct = _slurm(["sacct", "-n", "-X", "-P", "-j", str(job.id), "-o", "State,Elapsed,ExitCode,NodeList"])
    fields = acct.stdout.strip().split("|") if acct.returncode == 0 else []
    if len(fields) == 4:
        job.state = fields[0].split()[0]
        job.elapsed, job.exit_code, job.nodes = fields[1:]
    return job


def _status(job: Job) -> str:
    if job.state.split()[0] in WAITING_STATES:
        why = f" ({job.reason})" if job.reason and job.reason != "None" else ""
        return f"{job.state} for {job.pending_s:.0f} s{why}"
    pended = f" after {job.pending_s:.0f} s pending" if job.pending_s >= 1 else ""
    return f"{job.state} (ran {job.elapsed}{pended})"


def _display(job: Job, tail: int, handle) -> object:
    text = f"job {job.id} {job.script.name}: {_status(job)}{'  on ' + job.nodes if job.nodes else ''}"
    lines = [text, *("  | " + line for line in job.tail(tail))] if tail else [text]
    try:
        from IPython import get_ipython
        from IPython.display import display, update_display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        content = {"text/plain": "\n".join(lines)}
        if handle is None:
            handle = f"job-{job.id}-{time.monotonic_ns()}"
            display(content, raw=True, display_id=handle)
        else:
            update_display(content, raw=True, display_id=handle)
        return handle
    key = f"{job.state} {job.reason}"  # outside IPython: one line per change of state or reason
    if handle != key:
        print(text, flush=True)
    return key


def _check_limits(job: Job, timeout: float, pending_timeout: float) -> None:
    """Cancel and raise when the job can never start or has used up its pending or running time."""
    waiting = job.state.split()[0] in WAITING_STATES
    reason = job.reason.split(",")[0]
    if waiting and reason in HOPELESS_REASONS:
        _slurm(["scancel", str(job.id)])
        raise JobError(
            f"job {job.id} ({job.script.name}) can never start: Slurm says {job.reason}, "
            f"{HOPELESS_REASONS[reason]}. Cancelled it; ask for fewer nodes, GPUs or less time "
            "(`sinfo` and `scontrol show partition` show what the partition has)"
        )
    if waiting and job.pending_s > pending_timeout:
        _slurm(["scancel", str(job.id)])
        raise JobTimeout(
            f"job {job.id} ({job.script.name}) still {job.state} ({job.reason}) after "
            f"{job.pending_s:.0f} s in the queue: cancelled it. On a busy cluster raise "
            "pending_timeout= (or $LAB_PENDING_TIMEOUT), or ask for less"
        )
    if not waiting and job.running_s > timeout:
        _slurm(["scancel", str(job.id)])
        raise JobTimeout(
            f"job {job.id} ({job.script.name}) still {job.state} after {job.running_s:.0f} s "
            f"of running (timeout={timeout:.0f} s; it pended {job.pending_s:.0f} s before): "
            "cancelled it. Last lines:\n" + "\n".join(job.tail(10))
        )


def wait(
    job: Job,
    timeout: float = 600,
    poll: float = 0.25,
    tail: int = 5,
    check: bool = True,
    pending_timeout: float | None = None,
) -> Job:
    """Wait until the job ends; raise JobFailed unless COMPLETED (when ``check``).

    ``poll`` is the seconds between two looks (``scontrol show job``, about 5 ms of CPU each): a
    notebook runs dozens of short jobs one after another, and each waits half a poll on average.

    ``timeout`` bounds the running time, ``pending_timeout`` (default ``$LAB_PENDING_TIMEOUT``
    or 3600 s) the time in the queue; both are counted from what this call sees.
    """
    if pending_timeout is None:
        pending_timeout = float(os.environ.get("LAB_PENDING_TIMEOUT", DEFAULT_PENDING_TIMEOUT))
    handle, last = None, time.monotonic()
    while True:
        refresh(job)
        now = time.monotonic()
        if job.state.split()[0] in WAITING_STATES:
            job.pending_s += now - last
        else:
            job.running_s += now - last
        last = now
        handle = _display(job, tail, handle)
        if job.state.split()[0] in FINAL_STATES:
            break
        _check_limits(job, timeout, pending_timeout)
        time.sleep(poll)
    # The log may still be flushing on a shared file system: give it a moment.
    for _ in range(10):
        if job.log_path is None or job.log_path.exists():
            break
        time.sleep(0.2)
    if check and job.state != "COMPLETED":
        raise JobFailed(job)
    return job


def run(
    script: str | Path,
    *sbatch_args: str,
    timeout: float = 600,
    tail: int = 5,
    check: bool = True,
    pending_timeout: float | None = None,
) -> Job:
    """Submit ``script`` and wait for it (see :func:`wait`)."""
    job = submit(script, *sbatch_args)
    return wait(job, timeout=timeout, tail=tail, check=check, pending_timeout=pending_timeout)


def queue() -> str:
    """``squeue`` for the current user, printed and returned."""
    out = _slurm(["squeue", "-u", getpass.getuser()]).stdout.rstrip()
    print(out)
    return out
