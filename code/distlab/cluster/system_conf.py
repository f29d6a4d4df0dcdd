"""``/etc/slurm/slurm.conf``: the configuration that plain ``sinfo`` (no ``SLURM_CONF``) reads.

Slurm's commands read ``$SLURM_CONF``, else ``/etc/slurm/slurm.conf``. The lab links the latter to
its own configuration so that any shell can use the local cluster, under three rules:

* nothing there, a dangling link, or a link to a lab configuration whose cluster is not running
  (another checkout's, stopped): the link is (re)pointed at this checkout's configuration;
* a link to a configuration whose controller is running (another checkout's live cluster): left;
* a regular file (a real cluster's configuration): never touched.

``gres.conf`` beside it follows ``slurm.conf``.
"""

from __future__ import annotations

import re
from pathlib import Path

from distlab.cluster.config import ClusterPaths
from distlab.cluster.process import alive

ETC_SLURM = Path("/etc/slurm")


def _controller_running(conf: Path) -> bool:
    """Whether the slurmctld named by ``conf``'s SlurmctldPidFile is alive."""
    try:
        found = re.search(r"^SlurmctldPidFile=(\S+)", conf.read_text(), re.MULTILINE)
    except OSError:
        return False
    return bool(found and alive(Path(found.group(1)), "slurmctld"))


def describe(p: ClusterPaths, etc: Path = ETC_SLURM) -> str:
    """One line: which configuration plain ``sinfo`` uses, and whose it is."""
    system = etc / "slurm.conf"
    if not system.is_symlink():
        what = "a configuration file of this machine" if system.exists() else "nothing: no such file"
        return f"plain `sinfo` (no SLURM_CONF) reads {system}: {what}"
    target = system.resolve()
    if target == p.conf.resolve():
        whose = "this cluster"
    elif _controller_running(target):
        whose = "ANOTHER cluster, running (left alone; use SLURM_CONF or ./lab for this one)"
    else:
        whose = "another cluster, not running (repointed at the next `./lab cluster start`)"
    return f"plain `sinfo` (no SLURM_CONF) reads {system} -> {target}: {whose}"


def link(p: ClusterPaths, etc: Path = ETC_SLURM) -> bool:
    """Point ``etc/slurm.conf`` (and ``gres.conf``) at this cluster's, under the rules above.

    Returns whether the links now lead to this cluster's configuration."""
    system = etc / "slurm.conf"
    if system.exists() and not system.is_symlink():
        return False
    other = system.is_symlink() and system.resolve() != p.conf.resolve()
    if other and _controller_running(system.resolve()):
        return False
    etc.mkdir(parents=True, exist_ok=True)
    for name, target in (("slurm.conf", p.conf), ("gres.conf", p.gres_conf)):
        path = etc / name
        if path.is_symlink() or not path.exists():  # never replace a regular file
            path.unlink(missing_ok=True)
            path.symlink_to(target)
    return True
