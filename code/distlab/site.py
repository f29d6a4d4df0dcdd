"""Site profiles: how the same notebooks adapt to a cluster without edits.

A profile is ``sites/<name>.sh``, a shell file of exports (see ``sites/local.sh`` and
``sites/example-gpu.sh``). The chosen one is ``$LAB_SITE`` (default ``local``). Its ``SBATCH_*``
variables are sbatch's input environment variables: they override ``#SBATCH`` lines, so the
partition, account, time limit and GPUs per node come from the site, not from the notebook.
``srun`` and ``salloc`` typed in a cell read their own names for the same settings
(``SLURM_PARTITION``, ``SALLOC_PARTITION``, ...): :func:`command_env` gives them.
"""

from __future__ import annotations

import functools
import os
import subprocess

from distlab import REPO_ROOT

SITES_DIR = REPO_ROOT / "sites"
#: What the batch scripts cannot do without (sites/job-env.sh checks the same).
REQUIRED = ("LAB_PROCS_PER_NODE", "LAB_BACKEND")
#: sbatch settings that srun (SLURM_*) and salloc (SALLOC_*) read under their own names.
SHARED_SETTINGS = ("PARTITION", "ACCOUNT", "QOS", "RESERVATION", "GPUS_PER_NODE")


def current() -> str:
    return os.environ.get("LAB_SITE", "local")


def profile_env(name: str | None = None) -> dict[str, str]:
    """The variables that sourcing ``sites/<name>.sh`` sets or changes (with ``LAB_ROOT``).

    Without a name, the site is ``$LAB_SITE`` at the time of the call (a later change is seen).
    """
    return _profile_env(name or current())


@functools.cache
def _profile_env(name: str) -> dict[str, str]:
    path = SITES_DIR / f"{name}.sh"
    if not path.is_file():
        known = sorted(p.stem for p in SITES_DIR.glob("*.sh") if p.stem != "job-env")
        raise FileNotFoundError(f"no site profile {path}: LAB_SITE={name!r}; known sites: {known}")
    base = {"LAB_ROOT": str(REPO_ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    out = subprocess.run(
        ["bash", "-c", f'set -a; source "{path}" >/dev/null && env -0'],
        env=base,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    env = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    changed = {k: v for k, v in env.items() if base.get(k) != v and k not in ("_", "SHLVL", "PWD")}
    missing = [k for k in REQUIRED if not changed.get(k)]
    if missing:
        raise ValueError(f"site profile {path} does not set {', '.join(missing)}: add them to {path}")
    return {"LAB_ROOT": str(REPO_ROOT), "LAB_SITE": name, **changed}


def command_env(profile: dict[str, str]) -> dict[str, str]:
    """The profile plus its ``SBATCH_<X>`` settings as ``SLURM_<X>`` (srun) and ``SALLOC_<X>``."""
    env = dict(profile)
    for key in SHARED_SETTINGS:
        if f"SBATCH_{key}" in profile:
            env[f"SLURM_{key}"] = env[f"SALLOC_{key}"] = profile[f"SBATCH_{key}"]
    return env
