"""/etc/slurm/slurm.conf: repointed from a stopped cluster's configuration, never from a live one
or a real file (tested in a scratch folder standing for /etc/slurm)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from distlab.cluster import ClusterPaths, system_conf


def lab_conf(root: Path, pid: int | None = None) -> ClusterPaths:
    """A lab cluster's configuration files whose controller pid file holds ``pid``."""
    paths = ClusterPaths(root=root)
    root.mkdir(parents=True)
    paths.conf.write_text(f"ClusterName=lab\nSlurmctldPidFile={paths.ctld_pid}\n")
    paths.gres_conf.write_text("AutoDetect=off\n")
    if pid is not None:
        paths.ctld_pid.write_text(f"{pid}\n")
    return paths


@pytest.fixture
def running_controller(tmp_path):
    """A process whose command name is ``slurmctld``, as the liveness check sees a controller."""
    exe = tmp_path / "bin" / "slurmctld"
    exe.parent.mkdir()
    shutil.copy(shutil.which("sleep"), exe)
    proc = subprocess.Popen([str(exe), "60"])
    # Popen returns once exec has closed the close-on-exec pipe, but the kernel renames the task
    # (/proc/<pid>/comm) a little later in exec: on a loaded machine the check could see the
    # parent's name. Wait for the new name.
    comm, deadline = Path(f"/proc/{proc.pid}/comm"), time.monotonic() + 10
    while comm.read_text().strip() != "slurmctld":
        assert time.monotonic() < deadline, f"the stand-in controller is still {comm.read_text()!r}"
        time.sleep(0.01)
    yield proc.pid
    proc.kill()
    proc.wait()


def test_missing_link_is_created(tmp_path):
    ours, etc = lab_conf(tmp_path / "ours"), tmp_path / "etc"
    assert system_conf.link(ours, etc)
    assert (etc / "slurm.conf").resolve() == ours.conf and (etc / "gres.conf").resolve() == ours.gres_conf
    assert system_conf.describe(ours, etc).endswith(f"-> {ours.conf}: this cluster")


def test_link_to_a_stopped_cluster_is_repointed(tmp_path):
    ours, etc = lab_conf(tmp_path / "ours"), tmp_path / "etc"
    stopped = lab_conf(tmp_path / "other", pid=999_999)  # a pid file left by a cluster now stopped
    system_conf.link(stopped, etc)
    assert "another cluster, not running" in system_conf.describe(ours, etc)
    assert system_conf.link(ours, etc)
    assert (etc / "slurm.conf").resolve() == ours.conf and (etc / "gres.conf").resolve() == ours.gres_conf


def test_dangling_link_is_repointed(tmp_path):
    ours, etc = lab_conf(tmp_path / "ours"), tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").symlink_to(tmp_path / "deleted-checkout" / "slurm.conf")
    assert system_conf.link(ours, etc)
    assert (etc / "slurm.conf").resolve() == ours.conf


def test_link_to_a_running_cluster_is_left_alone(tmp_path, running_controller):
    ours, etc = lab_conf(tmp_path / "ours"), tmp_path / "etc"
    live = lab_conf(tmp_path / "other", pid=running_controller)
    system_conf.link(live, etc)
    assert not system_conf.link(ours, etc)
    assert (etc / "slurm.conf").resolve() == live.conf and (etc / "gres.conf").resolve() == live.gres_conf
    assert "ANOTHER cluster, running" in system_conf.describe(ours, etc)


def test_a_real_configuration_file_is_never_touched(tmp_path):
    ours, etc = lab_conf(tmp_path / "ours"), tmp_path / "etc"
    etc.mkdir()
    (etc / "slurm.conf").write_text("ClusterName=production\n")
    assert not system_conf.link(ours, etc)
    assert (etc / "slurm.conf").read_text() == "ClusterName=production\n" and not (etc / "gres.conf").exists()
    assert "a configuration file of this machine" in system_conf.describe(ours, etc)
