"""Site profiles: what a profile sets reaches sbatch, srun and salloc; a gap is named with its file."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from distlab import REPO_ROOT, site


@pytest.fixture
def sites(tmp_path, monkeypatch):
    """A sites/ folder of our own, with the real job-env.sh and local.sh in it."""
    folder = tmp_path / "sites"
    folder.mkdir()
    for name in ("job-env.sh", "local.sh", "example-gpu.sh"):
        shutil.copy(REPO_ROOT / "sites" / name, folder / name)
    monkeypatch.setattr(site, "SITES_DIR", folder)
    site._profile_env.cache_clear()
    yield folder
    site._profile_env.cache_clear()


def test_every_shipped_profile_sets_what_the_scripts_need(sites):
    for name in ("local", "example-gpu"):
        env = site.profile_env(name)
        assert all(env[key] for key in site.REQUIRED), name
        assert env["LAB_CIFAR_SOURCE"] in ("generate", "download")
    assert site.profile_env("example-gpu")["LAB_BACKEND"] == "nccl"


def test_an_unnamed_call_follows_lab_site(sites, monkeypatch):
    monkeypatch.setenv("LAB_SITE", "local")
    assert site.profile_env()["LAB_BACKEND"] == "gloo"
    monkeypatch.setenv("LAB_SITE", "example-gpu")  # set later in the same process (a notebook cell)
    assert site.profile_env()["LAB_BACKEND"] == "nccl"


def test_missing_variable_is_named_with_the_file(sites):
    text = (sites / "local.sh").read_text().replace("export LAB_PROCS_PER_NODE=2", "")
    (sites / "gap.sh").write_text(text)
    with pytest.raises(ValueError, match=r"gap.sh does not set LAB_PROCS_PER_NODE: add them to .*gap.sh"):
        site.profile_env("gap")


def test_job_env_names_the_missing_variable_and_the_file(sites):
    text = (sites / "local.sh").read_text().replace("export LAB_BACKEND=gloo", "")
    (sites / "gap.sh").write_text(text)
    env = {"PATH": os.environ["PATH"], "LAB_ROOT": str(sites.parent), "LAB_SITE": "gap"}
    out = subprocess.run(
        ["bash", "-c", 'source "$LAB_ROOT/sites/job-env.sh"; echo reached'],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1 and "reached" not in out.stdout
    assert f"LAB_BACKEND is not set: add it to {sites / 'gap.sh'}" in out.stderr


def test_srun_and_salloc_get_the_sbatch_settings(sites):
    env = site.command_env(site.profile_env("example-gpu"))
    assert env["SLURM_PARTITION"] == env["SALLOC_PARTITION"] == env["SBATCH_PARTITION"] == "gpu"
    assert env["SLURM_ACCOUNT"] == env["SALLOC_ACCOUNT"] == "my-project"
    assert env["SLURM_GPUS_PER_NODE"] == "4" and "SLURM_QOS" not in env  # commented out there
    assert env["SRUN_CPUS_PER_TASK"] == "8"


def test_site_shell_files_parse():
    """Profiles, job-env.sh and the PBS example are valid bash (PBS itself cannot run here)."""
    files = sorted((REPO_ROOT / "sites").glob("*.sh")) + [REPO_ROOT / "sites" / "pbs-example.pbs"]
    for path in files:
        out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, (path, out.stderr)
    pbs = (REPO_ROOT / "sites" / "pbs-example.pbs").read_text()
    assert '--hostfile "$PBS_NODEFILE"' in pbs and "-x MASTER_ADDR -x MASTER_PORT" in pbs
