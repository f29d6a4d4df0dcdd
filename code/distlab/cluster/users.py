"""Learner accounts: the ordinary users who run JupyterLab and submit jobs to the local cluster.

The lab is set up as root, as an administrator would, and used as an ordinary user, as on a real
cluster: ``sudo ./lab up`` runs JupyterLab, and so every job, as the user who called sudo, or as
``learner`` when root ran it directly. :func:`ensure` makes a user ready, and is safe to repeat:

* the Linux account, created only if missing (``useradd --create-home``, home mode 0700);
* its association in Slurm's accounting (account ``learners``, see ``accounting.add_user``);
* its workspace ``~/distlab-course/`` (mode 0700), made by the user, never by root inside it::

      notebooks/ solutions/   the learner's own copies: a later call adds new ones, keeps edits
      data/ runs/             what notebooks and jobs write (datasets, TensorBoard, checkpoints)
      code sites images README.md .venv   links into the checkout, which stays root's, read-only

JupyterLab runs with ``LAB_ROOT`` set to the workspace, so there ``distlab.REPO_ROOT`` is the
workspace: ``data/`` and ``runs/`` are the learner's own, and the links lead to the shared code
and Python environment. With umask 077, what a learner writes (notebooks, job scripts, logs,
checkpoints) is theirs alone; tests/test_cluster_users.py has another user try and be refused.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from distlab.cluster import accounting
from distlab.cluster.config import ClusterPaths
from distlab.cluster.daemons import closed_folder
from distlab.cluster.process import ClusterError

#: The checkout that holds this package (not ``REPO_ROOT``, which may name a workspace).
CHECKOUT = Path(__file__).resolve().parents[3]
WORKSPACE = "distlab-course"
#: Where ``./lab test`` runs the notebooks as the learner: laid out as the workspace, but with the
#: checkout's notebooks copied anew each time, so that a learner's own edits are never overwritten.
TEST_WORKSPACE = "distlab-course-test"
COPIED = ("notebooks", "solutions")  # *.ipynb: each learner's own copy
OWN = ("data", "runs")  # empty at first, the learner's
LINKED = ("code", "sites", "images", "README.md", ".venv", "notebooks/GLOSSARY.md")  # shared, read-only
NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
COMMENT = "lab learner"  # the GECOS field of the accounts made here


@dataclass(frozen=True)
class Learner:
    name: str
    uid: int
    gid: int
    home: Path

    @property
    def workspace(self) -> Path:
        return self.home / WORKSPACE

    def env(self, **extra: str) -> dict[str, str]:
        """A fresh login's variables (none of the caller's leak in), plus ``extra``."""
        login = {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name, "SHELL": "/bin/bash"}
        return {**login, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **extra}

    def run(
        self,
        cmd: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        input: str | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        """``cmd`` as this user (uid, gid, groups) with umask 077; output captured, never raises."""
        return subprocess.run(
            cmd,
            input=input,
            user=self.uid,
            group=self.gid,
            extra_groups=os.getgrouplist(self.name, self.gid),
            umask=0o077,
            env=env or self.env(),
            cwd=cwd or self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def lookup(name: str) -> Learner | None:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    return Learner(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def ensure(name: str, p: ClusterPaths | None = None, checkout: Path = CHECKOUT) -> Learner:
    """Make ``name`` ready to learn: account, workspace, and (with ``p``) Slurm association."""
    if os.geteuid() != 0:
        raise ClusterError("making a learner's account needs root: `sudo ./lab cluster add-user NAME`")
    learner = lookup(name)
    if learner is None:
        if not NAME.fullmatch(name):
            raise ClusterError(f"{name!r} is not a user name to create (lower case letters, digits, _ and -)")
        cmd = ["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", "--comment", COMMENT]
        out = subprocess.run([*cmd, name], capture_output=True, text=True, timeout=30)
        learner = lookup(name)
        if out.returncode != 0 or learner is None:
            raise ClusterError(f"`useradd {name}` failed ({out.returncode}): {out.stderr.strip()}")
        learner.home.chmod(0o700)  # what Debian's adduser does; useradd follows the umask
    if learner.uid == 0:
        raise ClusterError(f"{name} is root: choose an ordinary user (LAB_USER=<name>)")
    prepare_workspace(learner, checkout)
    if p is not None:
        accounting.add_user(p, name)
    return learner


#: Run as the learner: sh -c SCRIPT sh WORKSPACE CHECKOUT REFRESH (1: copies replace the notebooks).
WORKSPACE_SCRIPT = f"""set -eu
ws=$1 checkout=$2 refresh=$3
mkdir -p "$ws" && chmod 700 "$ws"
# a test workspace starts clean: a fresh cluster numbers its jobs from 1 again, and a log or
# checkpoint left by an earlier run under the same job id would pass for the new job's
if [ "$refresh" = 1 ]; then rm -rf {" ".join(f'"$ws/{d}"' for d in (*COPIED, "runs"))}; fi
for d in {" ".join(COPIED)}; do
    mkdir -p "$ws/$d"
    for f in "$checkout/$d"/*.ipynb; do
        [ "$refresh" = 1 ] || [ ! -e "$ws/$d/${{f##*/}}" ] || continue
        cp "$f" "$ws/$d/"
    done
done
for d in {" ".join(OWN)}; do mkdir -p "$ws/$d"; done
for f in {" ".join(LINKED)}; do ln -sfnT "$checkout/$f" "$ws/$f"; done
"""


def prepare_workspace(learner: Learner, checkout: Path = CHECKOUT, folder: str = WORKSPACE) -> Path:
    """Make or complete ``learner``'s workspace ``~/folder``, as the learner (see the module's
    docstring). The test workspace (:data:`TEST_WORKSPACE`) gets the checkout's notebooks anew."""
    ws = learner.home / folder
    refresh = "1" if folder == TEST_WORKSPACE else "0"
    out = learner.run(["sh", "-c", WORKSPACE_SCRIPT, "sh", str(ws), str(checkout), refresh])
    if out.returncode != 0:
        closed = closed_folder(checkout)
        why = f": {closed} is closed to other users" if closed else ""
        raise ClusterError(
            f"could not prepare {ws} as {learner.name}: {out.stderr.strip()} (every learner must "
            f"be able to read the checkout {checkout}{why}; move it, e.g. to /opt or /srv)"
        )
    return ws


def remove(name: str, p: ClusterPaths | None = None, grace_s: float = 10.0) -> None:
    """Delete ``name``'s account, home and association: for throwaway users (tests). Their
    processes go first: a job just cancelled (``scancel`` returns before its steps are gone) gets
    ``grace_s`` to end, then is killed, as ``userdel`` refuses a user who still runs one."""
    if p is not None:
        accounting.remove_user(p, name)
    if lookup(name) is not None:
        _end_processes(name, grace_s)
        out = subprocess.run(["userdel", "--remove", name], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise ClusterError(f"`userdel --remove {name}` failed ({out.returncode}): {out.stderr.strip()}")


def _end_processes(name: str, grace_s: float) -> None:
    """Wait up to ``grace_s`` for ``name``'s processes to end, then SIGKILL the rest and wait for them."""
    deadline = time.monotonic() + grace_s
    while _running(name):
        if time.monotonic() > deadline:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True, timeout=10)
            if time.monotonic() > deadline + 10:
                pids = _running(name)
                raise ClusterError(
                    f"{name}'s processes {pids} survived SIGKILL for 10 s: cannot remove {name}"
                )
        time.sleep(0.2)


def _running(name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-u", name], capture_output=True, text=True, timeout=10)
    return [int(pid) for pid in out.stdout.split()]
