"""distlab: the library behind the distributed deep-learning lab course.

Notebooks import from here; entry scripts in ``code/`` are what sbatch files launch.
"""

import os
from pathlib import Path

#: Repository root (the folder holding ``notebooks/``, ``code/`` and ``README.md``), or, where
#: ``$LAB_ROOT`` names one, a learner's workspace that mirrors it (``distlab.cluster.users``):
#: notebooks and jobs write ``data/`` and ``runs/`` under it.
REPO_ROOT = Path(os.environ.get("LAB_ROOT") or Path(__file__).resolve().parents[2]).resolve()

__all__ = ["REPO_ROOT"]
