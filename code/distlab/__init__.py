"""distlab: the library behind the distributed deep-learning lab course.

Notebooks import from here; entry scripts in ``code/`` are what sbatch files launch.
"""

from pathlib import Path

#: Repository root (the folder holding ``notebooks/``, ``code/`` and ``README.md``).
REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["REPO_ROOT"]
