"""Daemon processes of the local cluster: is it alive, wait until ready, stop it, run a client.

A daemon is identified by its pid file *and* its command name (``/proc/<pid>/comm``), so a stale
pid file whose number now belongs to another program is never mistaken for the daemon.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from distlab.cluster.config import ClusterPaths


class ClusterError(RuntimeError):
    """The local cluster cannot start or answer; the message says why and what to do."""


def alive(pid_file: Path, name: str) -> int | None:
    """Pid of the daemon ``name`` recorded in ``pid_file``, if it is running."""
    try:
        pid = int(pid_file.read_text().split()[0])
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return pid if comm == name[:15] and state != "Z" else None  # a zombie has exited


def port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def env(p: ClusterPaths) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(p.conf)}


def run(cmd: list[str], p: ClusterPaths, timeout: float = 30, check: bool = True) -> str:
    """stdout of a Slurm client command against this cluster; a failure raises with its stderr."""
    try:
        out = subprocess.run(cmd, env=env(p), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"`{' '.join(cmd)}` did not answer within {timeout:.0f} s") from e
    if check and out.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def log_tail(log: Path, lines: int = 10) -> str:
    tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else ["(no log yet)"]
    return f"last lines of {log}:\n" + "\n".join(tail)


def wait_for(
    what: str, ok: Callable[[], bool], timeout: float, log: Path, server: subprocess.Popen | None = None
) -> None:
    """Poll ``ok`` every 0.1 s; after ``timeout``, or once ``server`` exits, raise with ``log``'s tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        if server is not None and server.poll() is not None:
            raise ClusterError(f"{what} exited ({server.returncode}) while starting; {log_tail(log)}")
        time.sleep(0.1)
    raise ClusterError(f"{what} did not come up within {timeout:.0f} s; {log_tail(log)}")


def terminate(pid_file: Path, name: str, timeout: float = 15) -> None:
    """SIGTERM the daemon, SIGKILL it after ``timeout``; remove its pid file."""
    pid = alive(pid_file, name)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive(pid_file, name):
            time.sleep(0.05)
        if alive(pid_file, name):
            os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
