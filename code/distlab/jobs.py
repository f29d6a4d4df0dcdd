"""Job helpers for notebooks: submit an sbatch file, wait with a live view, read the log back.

Contract:
    * ``submit`` returns a :class:`Job` or raises :class:`JobError` carrying sbatch's own message;
    * ``wait`` polls until the job ends, never longer than ``timeout`` seconds (then the job is
      cancelled and :class:`JobTimeout` raised), showing state, elapsed time and the log's last
      lines; a job that ends in any state but COMPLETED raises :class:`JobFailed` with the job's
      own error lines;
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
from dataclasses import dataclass, field
from pathlib import Path

from distlab import site
from distlab.cluster.config import local_paths

#: Lines of a failed job's log worth showing first.
ERROR_PATTERN = re.compile(
    r"error|exception|traceback|killed|cancelled|time limit|out of memory|oom|failed|denied|"
    r"not found|no such file|refused|timed out",
    re.IGNORECASE,
)
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "SPECIAL_EXIT",
}
#: Pending reasons that waiting cannot cure: the request exceeds what the partition offers.
HOPELESS_REASONS = {
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "PartitionConfig",
    "BadConstraints",
    "ReqNodeNotAvail",
    "InvalidQOS",
    "InvalidAccount",
    "DependencyNeverSatisfied",
}


class JobError(RuntimeError):
    """sbatch refused the script, or Slurm could not be asked."""


@dataclass
class Job:
    """A submitted batch job and what Slurm last said of it."""

    id: int
    script: Path
    log_path: Path | None = None
    state: str = "PENDING"
    elapsed: str = "0:00"
    exit_code: str = ""
    nodes: str = ""
    reason: str = ""
    info: dict[str, str] = field(default_factory=dict, repr=False)

    def log(self) -> str:
        """The job's output file, as far as it has been written ('' before it exists)."""
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return ""

    def grep(self, pattern: str) -> list[str]:
        """Lines of the log that match the regular expression ``pattern``."""
        rx = re.compile(pattern)
        return [line for line in self.log().splitlines() if rx.search(line)]

    def tail(self, n: int = 10) -> list[str]:
        return self.log().splitlines()[-n:]

    def error_lines(self, n: int = 15) -> list[str]:
        return [line for line in self.log().splitlines() if ERROR_PATTERN.search(line)][-n:]


class JobFailed(JobError):
    """The job ended in a state other than COMPLETED."""

    def __init__(self, job: Job):
        self.job = job
        errors = job.error_lines()
        tail = job.tail(10)
        text = [
            f"job {job.id} ({job.script.name}) ended {job.state} (exit code {job.exit_code}) "
            f"after {job.elapsed} on {job.nodes or '-'}"
        ]
        if job.state == "TIMEOUT":
            text.append("it ran past its time limit (--time): shorten the work or raise the limit")
        if job.state == "OUT_OF_MEMORY":
            text.append("it ran out of memory: smaller batch or model, or ask for more (--mem)")
        if errors:
            text += ["--- error lines of its log ---", *errors]
        text += [f"--- last lines of {job.log_path} ---", *tail]
        super().__init__("\n".join(text))


class JobTimeout(JobError):
    """Waiting for the job took longer than the caller allowed; the job was cancelled."""


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


def setup_notebook(folder: str | Path = "jobs") -> None:
    """Prepare a notebook's session: job folder, site environment, and a look at the cluster."""
    jobs_dir = Path(folder).resolve()
    jobs_dir.mkdir(parents=True, exist_ok=True)
    env = _slurm_env()
    for key in ("LAB_ROOT", "LAB_SITE", "SLURM_CONF"):
        if key in env:
            os.environ[key] = env[key]
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


def _display(job: Job, tail: int, handle) -> object:
    text = (
        f"job {job.id} {job.script.name}: {job.state:<11s} elapsed {job.elapsed}"
        f"{'  (' + job.reason + ')' if job.state == 'PENDING' and job.reason else ''}"
        f"{'  on ' + job.nodes if job.nodes else ''}"
    )
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
    if handle != text.split(" elapsed")[0] + job.state:
        print(text, flush=True)
    return text.split(" elapsed")[0] + job.state


def wait(job: Job, timeout: float = 600, poll: float = 1.0, tail: int = 5, check: bool = True) -> Job:
    """Wait until the job ends; raise JobFailed unless COMPLETED (when ``check``)."""
    deadline = time.monotonic() + timeout
    handle = None
    while True:
        refresh(job)
        handle = _display(job, tail, handle)
        if job.state.split()[0] in FINAL_STATES:
            break
        if job.state == "PENDING" and job.reason.split(",")[0] in HOPELESS_REASONS:
            _slurm(["scancel", str(job.id)])
            raise JobError(
                f"job {job.id} ({job.script.name}) can never start: Slurm says "
                f"{job.reason}. Cancelled it; ask for fewer nodes, GPUs or less time "
                "(`sinfo` shows what the partition has)"
            )
        if time.monotonic() > deadline:
            _slurm(["scancel", str(job.id)])
            raise JobTimeout(
                f"job {job.id} ({job.script.name}) still {job.state} after {timeout:.0f} s "
                f"of waiting: cancelled it. Last lines:\n" + "\n".join(job.tail(10))
            )
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
    script: str | Path, *sbatch_args: str, timeout: float = 600, tail: int = 5, check: bool = True
) -> Job:
    """Submit ``script`` and wait for it (see :func:`wait`)."""
    return wait(submit(script, *sbatch_args), timeout=timeout, tail=tail, check=check)


def queue() -> str:
    """``squeue`` for the current user, printed and returned."""
    out = _slurm(["squeue", "-u", getpass.getuser()]).stdout.rstrip()
    print(out)
    return out


def cancel_mine() -> int:
    """Cancel every job of the current user; return how many there were."""
    user = getpass.getuser()
    ids = _slurm(["squeue", "-h", "-u", user, "-o", "%i"]).stdout.split()
    if ids:
        _slurm(["scancel", *ids])
    return len(ids)
