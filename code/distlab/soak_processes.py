"""What ``./lab soak`` (:mod:`distlab.soak`) starts beside its runs, and how it stops them and what
they leave: the busy processes of ``--load``, a run with every process it started (the learner's
pytest, Jupyter's kernels in sessions of their own), and the Slurm jobs a stopped notebook left."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from distlab.cluster.users import TEST_WORKSPACE

#: A busy process: loops on one core, and stops by itself within a second once its parent
#: (argv[1]) is gone (killed with SIGKILL, which no cleanup sees). Not sooner: the soak stops them
#: itself, and tests/test_soak.py tells the two apart by looking right at the soak's exit.
BUSY_LOOP = """import os, sys, time
parent = int(sys.argv[1])
while os.getppid() == parent:
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pass
"""
#: How long an interrupted run gets to stop after SIGINT (pytest then shuts its kernel down), then
#: after SIGTERM, before SIGKILL.
STOP_GRACE_S = (20.0, 5.0)


@contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` busy processes while the block runs, stopped (and reaped) when it ends however
    it ends. Each is its own session, so that a Ctrl-C in the terminal reaches this process only."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", BUSY_LOOP, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,  # not the soak's: a reader would wait for them too
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()


def stop_run(proc: subprocess.Popen[bytes]) -> None:
    """Stop a run and all it started: SIGINT (pytest stops its notebook and shuts the kernel down),
    then SIGTERM, then SIGKILL (:data:`STOP_GRACE_S`), each to the run's process group and to every
    descendant, until none is left. Waiting for ``proc`` alone is not enough: when root soaks, it is
    the ``lab`` shell, which ends at the first SIGINT while the learner's pytest below it goes on with
    the next notebook; and Jupyter starts each kernel in a session of its own, out of the group."""
    family: dict[int, psutil.Process] = {}
    for sig, grace in (
        (signal.SIGINT, STOP_GRACE_S[0]),
        (signal.SIGTERM, STOP_GRACE_S[1]),
        (signal.SIGKILL, STOP_GRACE_S[1]),
    ):
        for p in _descendants(proc.pid):
            family.setdefault(p.pid, p)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for p in list(family.values()):
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                family.pop(p.pid)
        _, alive = psutil.wait_procs(list(family.values()), timeout=grace)
        family = {p.pid: p for p in alive}
        if not family and not _group_alive(proc.pid):
            break
    proc.wait()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def cancel_left_jobs(owner: str | None, workspace: Path | None = None) -> list[str]:
    """Cancel the Slurm jobs a run left queued or running: ``owner``'s jobs (this user's when
    None) whose working folder is in ``workspace`` (default: their test workspace, where the runs'
    notebooks submit from). A notebook stopped mid-cell, or one that failed before its cleanup,
    leaves its job to hold the nodes that the next run's notebooks wait for. Returns their ids."""
    if shutil.which("squeue") is None:
        return []
    user = owner or pwd.getpwuid(os.geteuid()).pw_name
    workspace = workspace or Path(pwd.getpwnam(user).pw_dir) / TEST_WORKSPACE
    out = subprocess.run(
        ["squeue", "-h", "-u", user, "-o", "%i %Z"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    left = [
        job
        for job, _, folder in (line.partition(" ") for line in out.splitlines())
        if Path(folder) == workspace or Path(folder).is_relative_to(workspace)
    ]
    if left:
        subprocess.run(["scancel", *left], capture_output=True, timeout=30, check=False)
    return left
