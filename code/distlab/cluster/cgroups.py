"""Memory cgroups of the local cluster: each job step confined to its ``--mem`` by the kernel.

Slurm's task/cgroup puts every job step of node ``nodeK`` in
``/sys/fs/cgroup/memory/slurm_nodeK/uid_<uid>/job_<id>/step_<step>`` (cgroup v1) with
``memory.limit_in_bytes`` set to the job's memory; a step that allocates past it meets the kernel's
OOM killer *inside that cgroup only*, and slurmstepd reports ``Detected 1 oom-kill event(s)`` and
ends the job ``OUT_OF_MEMORY``.

Two clusters on one host (the shared one and a test's private one) would both use ``slurm_node1``
and collide on equal job ids, so each slurmd starts inside this cluster's folder
``/sys/fs/cgroup/<controller>/distlab-<port>``, in a cgroup namespace rooted there, and in a mount
namespace where that folder is bind-mounted over ``/sys/fs/cgroup/<controller>``. Its jobs live
under that folder, and inside a job ``/proc/self/cgroup`` (``/slurm_node1/uid_0/job_<id>/...``)
names the job's own folder under ``/sys/fs/cgroup/memory``, as on a real node.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from pathlib import Path

from distlab.cluster.config import ClusterPaths

#: Controllers Slurm uses here: memory (task/cgroup's limit) and freezer (proctrack/cgroup).
CONTROLLERS = ("memory", "freezer")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def available() -> bool:
    """Whether the cgroup v1 memory and freezer controllers are mounted and writable."""
    return all(
        (CGROUP_ROOT / c / "cgroup.procs").exists() and os.access(CGROUP_ROOT / c, os.W_OK)
        for c in CONTROLLERS
    )


def cluster_folder(p: ClusterPaths, controller: str) -> Path:
    return CGROUP_ROOT / controller / f"distlab-{p.port_base}"


def slurmd_command(p: ClusterPaths, node: str, cgroups: bool) -> list[str]:
    """``slurmd -N node`` in its own UTS namespace (hostname ``node``) and, with cgroups, in this
    cluster's cgroup folders, with its own cgroup namespace (so ``/proc/self/cgroup`` reads
    ``/slurm_nodeK/...``) and mount namespace (where that path exists under /sys/fs/cgroup)."""
    inner = [f"hostname {node}"]
    outer, unshare = [], ["unshare", "--uts"]
    if cgroups:
        unshare += ["--mount", "--propagation", "private", "--cgroup"]
        for c in CONTROLLERS:
            folder = cluster_folder(p, c)
            folder.mkdir(exist_ok=True)
            outer.append(f"echo $$ > {shlex.quote(str(folder / 'cgroup.procs'))}")
            inner.append(f"mount --bind {shlex.quote(str(folder))} {CGROUP_ROOT / c}")
    inner.append(f"exec slurmd -N {node} -f {shlex.quote(str(p.conf))}")
    outer.append(f"exec {shlex.join([*unshare, 'sh', '-c', ' && '.join(inner)])}")
    return ["sh", "-c", " && ".join(outer)]


def remove_folders(p: ClusterPaths, timeout: float = 5) -> None:
    """Remove this cluster's cgroup folders, deepest first, once its slurmd have stopped.

    A process that just exited may hold its folder for a moment, so this retries up to
    ``timeout`` s; a folder still holding a process after that (a job step that outlived its
    slurmd) is left."""
    deadline = time.monotonic() + timeout
    for c in CONTROLLERS:
        top = cluster_folder(p, c)
        while top.exists():
            inner = sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts))
            for folder in [*inner, top]:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
