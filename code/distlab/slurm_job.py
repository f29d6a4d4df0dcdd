"""A batch job as Slurm reports it: its states, the :class:`Job` record, and the errors.

``distlab.jobs`` fills a :class:`Job` from ``scontrol``/``sacct`` and raises these errors; the
sets below say which states end a job, which mean it still waits, and which pending reasons
waiting can never cure.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

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
#: States in which a job waits rather than computes: its time counts as pending.
WAITING_STATES = {"PENDING", "CONFIGURING", "SUSPENDED", "REQUEUED"}
#: Pending reasons that waiting cannot cure, with what they mean. Reasons that clear by
#: themselves on a busy cluster (Resources, Priority, ReqNodeNotAvail, Dependency, JobHeldUser)
#: are waited for.
HOPELESS_REASONS = {
    "PartitionNodeLimit": "more nodes than the partition allows",
    "PartitionTimeLimit": "a time limit over the partition's maximum",
    "PartitionConfig": "more CPUs, GPUs or memory than the partition's nodes have",
    "BadConstraints": "a feature, GPU count or node list no node offers",
    "InvalidQOS": "a QOS this account may not use",
    "InvalidAccount": "an account you are not a member of",
    "QOSMaxWallDurationPerJobLimit": "a time limit over the QOS's maximum",
    "QOSMaxNodePerJobLimit": "more nodes than the QOS allows one job",
    "QOSMaxGRESPerJob": "more GPUs than the QOS allows one job",
    "DependencyNeverSatisfied": "a dependency that can no longer be met (the job it waits for ended otherwise)",
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
    pending_s: float = 0.0  # seconds this job was seen waiting in the queue
    running_s: float = 0.0  # seconds it was seen running
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
        """The last ``n`` lines, read from the file's last 64 KiB (a wait shows them at every poll)."""
        if not (self.log_path and self.log_path.exists()):
            return []
        with self.log_path.open("rb") as f:
            start = f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
        return lines[1 if start else 0 :][-n:]  # from inside the file: its first line is cut

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
    """The job ran, or pended, longer than the caller allowed; the job was cancelled."""
