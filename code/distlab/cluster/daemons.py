"""Start, stop, inspect and reset the local cluster's daemons.

In order: munged, the accounting database and slurmdbd (``accounting.py``), slurmctld, 2 x slurmd.

Each ``slurmd -N nodeK`` runs in its own UTS namespace (``unshare --uts``) with its hostname set
to ``nodeK``, so ``srun hostname`` prints node1 and node2 and launchers that compare host names
(torchrun's c10d rendezvous, Open MPI) see two machines. The names resolve to 127.0.0.11/12
through ``/etc/hosts``.

Every operation is safe to repeat: starting a running cluster checks it and returns, stopping a
stopped one does nothing, stale pid files and sockets are cleared, and a port held by some other
program is reported with the way out.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

from distlab import REPO_ROOT
from distlab.cluster import accounting, cgroups, system_conf
from distlab.cluster.config import (
    NODES,
    PORT_FILE,
    ClusterPaths,
    cgroup_conf,
    gres_conf,
    local_paths,
    slurm_conf,
)
from distlab.cluster.process import ClusterError, alive, env, port_busy, run, terminate, wait_for

REQUIRED = {
    "munged": "munge",
    "mungekey": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "slurmdbd": "slurmdbd",
    "mariadbd": "mariadb-server",
    "sinfo": "slurm-client",
    "unshare": "util-linux",
}
HOSTS_MARK = "# distlab local cluster"


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise ClusterError(
            "the local cluster runs Slurm's daemons as root (slurmd must, to start jobs): "
            "run as root, e.g. `sudo ./lab cluster start`"
        )
    missing = sorted({pkg for exe, pkg in REQUIRED.items() if shutil.which(exe) is None})
    if missing:
        raise ClusterError(
            f"missing Debian packages: {' '.join(missing)}; run `./lab setup` "
            f"(or `apt-get install {' '.join(missing)}`)"
        )


def _ensure_hosts() -> None:
    """Make node names resolvable: ``127.0.0.11 node1`` ... in /etc/hosts (once)."""
    hosts = Path("/etc/hosts")
    text = hosts.read_text()
    lines = [f"{addr} {name} {HOSTS_MARK}" for name, addr in NODES]
    missing = [line for line in lines if line not in text]
    if missing:
        hosts.write_text(text.rstrip("\n") + "\n" + "\n".join(missing) + "\n")


#: Mode of each folder: open where every user's commands must reach, root's alone where secrets
#: or other users' job scripts lie (the permission model: config.py's docstring).
FOLDER_MODES = {".": 0o755, "munge": 0o711, "log": 0o755, "ctld": 0o700, "dev": 0o755, "spool": 0o755}


def write_atomically(path: Path, text: str, mode: int) -> None:
    """``path`` holds ``text`` with ``mode``, and no reader ever sees it empty or half written.

    A running cluster's files are read by every ``sbatch`` and daemon: ``./lab cluster start`` on a
    running cluster (a second ``./lab test``, ``./lab up``) rewrote them in place, and an ``sbatch``
    reading at that moment found an empty ``slurm.conf`` and failed. An unchanged file is left as it
    is; a changed one is written beside it and renamed over it (``os.replace`` is atomic)."""
    if path.exists() and path.read_text() == text:
        path.chmod(mode)
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def _prepare_files(p: ClusterPaths) -> None:
    for d in (p.root, p.munge_dir, p.log_dir, p.root / "ctld", p.root / "dev"):
        d.mkdir(parents=True, exist_ok=True)
    for name, _ in NODES:
        (p.root / "spool" / name).mkdir(parents=True, exist_ok=True)
    for folder, mode in FOLDER_MODES.items():  # also repairs a cluster made before these modes
        (p.root / folder).chmod(mode)
    if not p.munge_key.exists():  # generated on first start, never committed
        subprocess.run(["mungekey", "--create", f"--keyfile={p.munge_key}"], check=True)
    p.munge_key.chmod(0o600)
    for i in range(2):
        dev = p.root / "dev" / f"gpu{i}"
        if not dev.exists():
            os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # same numbers as /dev/null
        dev.chmod(0o666)
    for path, text in (
        (p.conf, slurm_conf(p, cgroups.available())),
        (p.gres_conf, gres_conf(p)),
        (p.cgroup_conf, cgroup_conf()),
    ):
        write_atomically(path, text, 0o644)  # every user's sbatch reads them, whatever root's umask
    (p.root / PORT_FILE).write_text(f"{p.port_base}\n")  # what local_paths() reads back
    (p.root / PORT_FILE).chmod(0o644)
    if p == local_paths() and "LAB_CLUSTER_DIR" not in os.environ:
        system_conf.link(p)


def closed_folder(path: Path) -> Path | None:
    """The first folder on the way to ``path`` that other users cannot pass through, if any."""
    for folder in [*reversed(path.parents), path]:
        if folder.exists() and not folder.stat().st_mode & stat.S_IXOTH:
            return folder
    return None


def _start_munged(p: ClusterPaths) -> None:
    if alive(p.munge_pid, "munged"):
        return
    p.munge_pid.unlink(missing_ok=True)
    p.munge_socket.unlink(missing_ok=True)
    subprocess.run(
        [
            "munged",
            "--force",
            f"--socket={p.munge_socket}",
            f"--key-file={p.munge_key}",
            f"--pid-file={p.munge_pid}",
            f"--log-file={p.log_dir / 'munged.log'}",
            f"--seed-file={p.munge_dir / 'munged.seed'}",
        ],
        check=True,
        capture_output=True,
        text=True,
    )


def _check_ports(p: ClusterPaths) -> None:
    owned = {p.ctld_port: alive(p.ctld_pid, "slurmctld")}
    for i, (name, _) in enumerate(NODES):
        owned[p.slurmd_port(i)] = alive(p.slurmd_pid(name), "slurmd")
    owned[p.dbd_port] = alive(accounting.dbd_pid(p), "slurmdbd")
    owned[p.db_port] = alive(accounting.db_pid(p), "mariadbd")
    busy = [port for port in p.ports() if not owned[port] and port_busy(port)]
    if busy:
        raise ClusterError(
            f"port(s) {busy} already in use by another program (see `ss -ltnp`): stop it, or "
            f"choose other ports with `export LAB_CLUSTER_PORT=<base>` (now {p.port_base}; "
            f"the cluster uses base .. base+{len(p.ports()) - 1})"
        )


def _node_states(p: ClusterPaths) -> dict[str, str]:
    out = run(["sinfo", "-h", "-N", "-o", "%N %T"], p, check=False)
    return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)


def start(p: ClusterPaths | None = None, timeout: float = 90) -> str:
    """Bring the cluster up (or check that it is up) and return ``sinfo``'s answer."""
    p = p or local_paths()
    _check_prerequisites()
    _ensure_hosts()
    _check_ports(p)
    _prepare_files(p)
    _start_munged(p)
    accounting.start(p)
    if not alive(p.ctld_pid, "slurmctld"):
        p.ctld_pid.unlink(missing_ok=True)
        subprocess.run(["slurmctld", "-f", str(p.conf)], env=env(p), check=True)
        wait_for("slurmctld", lambda: alive(p.ctld_pid, "slurmctld"), 30, p.log_dir / "slurmctld.log")
    for name, _ in NODES:
        if not alive(p.slurmd_pid(name), "slurmd"):
            p.slurmd_pid(name).unlink(missing_ok=True)
            subprocess.run(cgroups.slurmd_command(p, name, cgroups.available()), env=env(p), check=True)
    up = ("idle", "mixed", "allocated", "completing")

    def nodes_up() -> bool:
        states = _node_states(p)
        stuck = [n for n, s in states.items() if s.rstrip("*~#") in ("down", "drained", "draining")]
        if stuck:  # e.g. left down by an earlier crash: the daemons are back, so resume
            run(["scontrol", "update", f"NodeName={','.join(stuck)}", "State=RESUME"], p, check=False)
        return len(states) == len(NODES) and all(s.rstrip("*~#") in up for s in states.values())

    wait_for("the nodes", nodes_up, timeout, p.log_dir / "slurmctld.log")
    return run(["sinfo"], p)


def restart_controller(p: ClusterPaths) -> str:
    """Stop slurmctld and slurmdbd so that the next :func:`start` runs them on rewritten
    configuration files; jobs keep running on the nodes and the restarted controller takes them
    back from its saved state."""
    terminate(p.ctld_pid, "slurmctld")
    terminate(accounting.dbd_pid(p), "slurmdbd")
    return "slurmctld and slurmdbd restarted on the new configuration (running jobs kept)"


def _cancel_all(p: ClusterPaths, timeout: float = 30) -> int:
    jobs = run(["squeue", "-h", "-o", "%i"], p, check=False).split()
    if jobs:
        run(["scancel", *jobs], p, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and run(["squeue", "-h", "-o", "%i"], p, check=False).split():
            time.sleep(0.5)
    return len(jobs)


def stop(p: ClusterPaths | None = None) -> str:
    """Cancel every job, then stop the daemons. Safe when already stopped."""
    p = p or local_paths()
    if not p.root.exists():
        return "local cluster: not set up, nothing to stop"
    cancelled = _cancel_all(p) if alive(p.ctld_pid, "slurmctld") else 0
    for name, _ in NODES:
        terminate(p.slurmd_pid(name), "slurmd")
    cgroups.remove_folders(p)
    terminate(p.ctld_pid, "slurmctld")
    accounting.stop(p)
    terminate(p.munge_pid, "munged")
    return f"local cluster stopped ({cancelled} job(s) cancelled)"


def status(p: ClusterPaths | None = None) -> str:
    """One line per daemon, then ``sinfo`` and ``squeue`` if the controller answers."""
    p = p or local_paths()
    lines = [f"config: {p.conf}", system_conf.describe(p), _users_line(p)]
    daemons = [
        ("munged", "munged", p.munge_pid),
        *accounting.daemons(p),
        ("slurmctld", "slurmctld", p.ctld_pid),
    ]
    daemons += [(name, "slurmd", p.slurmd_pid(name)) for name, _ in NODES]
    for label, exe, pid_file in daemons:
        pid = alive(pid_file, exe)
        lines.append(f"{label:10s} {f'running (pid {pid})' if pid else 'stopped'}")
    if alive(p.ctld_pid, "slurmctld"):
        lines += [run(["sinfo"], p, check=False).rstrip(), run(["squeue"], p, check=False).rstrip()]
    return "\n".join(lines)


def _users_line(p: ClusterPaths) -> str:
    closed = closed_folder(p.root)
    if closed is None:
        return "ordinary users: may submit jobs (slurm.conf and the munge socket are open to all)"
    mode = stat.S_IMODE(closed.stat().st_mode)
    return f"ordinary users: only root may submit jobs: {closed} (mode {mode:o}) is closed to others"


def is_up(p: ClusterPaths | None = None) -> bool:
    p = p or local_paths()
    return bool(alive(p.ctld_pid, "slurmctld")) and all(alive(p.slurmd_pid(n), "slurmd") for n, _ in NODES)


def reset(p: ClusterPaths | None = None) -> str:
    """Cancel all jobs, clear the job logs that notebooks wrote, and resume drained nodes."""
    p = p or local_paths()
    cancelled = _cancel_all(p)
    removed = 0
    for folder in (REPO_ROOT / "notebooks" / "jobs", REPO_ROOT / "solutions" / "jobs"):
        for log in folder.glob("*.out") if folder.exists() else []:
            log.unlink()
            removed += 1
    names = ",".join(n for n, _ in NODES)
    run(["scontrol", "update", f"NodeName={names}", "State=RESUME"], p, check=False)
    return f"cancelled {cancelled} job(s), removed {removed} job log(s)"
