"""Shared fixtures: the local cluster (skipped with a reason where Slurm is not running)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from distlab import REPO_ROOT


def cluster_available() -> bool:
    if shutil.which("sinfo") is None:
        return False
    env = {**os.environ, "SLURM_CONF": str(REPO_ROOT / ".lab" / "cluster" / "slurm.conf")}
    try:
        out = subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0


@pytest.fixture
def slurm_cluster(monkeypatch):
    """The running local cluster; the test is skipped (with the fix) when there is none."""
    if not cluster_available():
        pytest.skip("no Slurm cluster answers: run `./lab cluster start` (./lab test does)")
    monkeypatch.setenv("LAB_ROOT", str(REPO_ROOT))
    monkeypatch.setenv("SLURM_CONF", str(REPO_ROOT / ".lab" / "cluster" / "slurm.conf"))
    return REPO_ROOT
