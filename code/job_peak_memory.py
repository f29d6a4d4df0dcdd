"""Print the peak memory of the Slurm job this runs in, as its memory cgroup counted it.

Slurm (``task/cgroup`` with ``ConstrainRAMSpace=yes``) puts every job in a memory cgroup limited to
its ``--mem``; the kernel kills a process of the job when the cgroup's usage reaches the limit. That
usage counts each page once, for the cgroup that first touched it: shared libraries already cached
by other processes are not charged, so it is lower than the ``MaxRSS`` of ``sacct`` (a sum of resident
sets). Run it at the end of a batch script, after the job's steps::

    srun python code/pretrain_gpt.py ...; status=$?
    python code/job_peak_memory.py        # job 224: peak 1116 MiB of its 1300 MiB limit (memory cgroup v1)
    exit $status

cgroup v1: ``memory.max_usage_in_bytes`` of ``.../job_<id>``; cgroup v2: ``memory.peak`` (Linux 5.19+).
Outside a job, or without a memory cgroup, it says so and exits 0.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MiB = 2**20


def job_cgroup(proc_cgroup: str, job_id: str) -> Path | None:
    """The job's memory cgroup folder, from the lines of ``/proc/self/cgroup``."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") or controllers == "":  # v1 memory, or v2 unified
            found = re.match(rf"(.*/job_{job_id})(/|$)", path)
            if found:
                root = "/sys/fs/cgroup/memory" if controllers else "/sys/fs/cgroup"
                return Path(root + found.group(1))
    return None


def describe(folder: Path, job_id: str) -> str:
    for peak_name, limit_name, kind in (
        ("memory.max_usage_in_bytes", "memory.limit_in_bytes", "memory cgroup v1"),
        ("memory.peak", "memory.max", "memory cgroup v2"),
    ):
        peak_file = folder / peak_name
        if peak_file.exists():
            peak = int(peak_file.read_text())
            limit = (folder / limit_name).read_text().strip()
            of = f"of its {int(limit) / MiB:.0f} MiB limit" if limit.isdigit() else "(no limit)"
            return f"job {job_id}: peak {peak / MiB:.0f} MiB {of} ({kind})"
    return f"job {job_id}: no peak in {folder} (this kernel's cgroup has no peak counter)"


def main() -> None:
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        print("job_peak_memory: not in a Slurm job (no SLURM_JOB_ID)")
        return
    folder = job_cgroup(Path("/proc/self/cgroup").read_text(), job_id)
    if folder is None:
        print(f"job {job_id}: no memory cgroup (Slurm does not constrain memory on this cluster)")
        return
    print(describe(folder, job_id), flush=True)


if __name__ == "__main__":
    main()
