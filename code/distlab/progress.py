"""Each learner's exercise results, where the instructor can read them (issue 22, part 4).

Every :func:`distlab.checks.check` call, where ``$LAB_PROGRESS_DIR`` names a folder (the workshop's
JupyterLab servers set it), appends one JSON line to ``$LAB_PROGRESS_DIR/<user>.jsonl``::

    {"user": "learner01", "notebook": "02_collectives", "exercise": "rank 2 after reduce_scatter",
     "result": "ok", "time": "2026-11-24T20:01:02+00:00"}          result: ok | not yet | wrong

The folder belongs to root and the group ``lab-instructors``, mode 3753 (setgid, sticky): a learner
may create a file there (``-wx`` for others) but neither list the folder nor remove another's file;
each file is created 0640 and takes the folder's group, so the instructors read every file and the
learners none but their own. A file counts only when its owner is the user it is named after, so
that no learner can write results in another's name.

``python -m distlab.progress [--folder DIR] [--plot FILE]`` (``./lab progress``) prints learners x
exercises (``+`` passed, ``x`` wrong so far, ``.`` not yet), writes the heat map, and lists each
learner's jobs in the queue.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import subprocess
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

FOLDER_VARIABLE = "LAB_PROGRESS_DIR"
INSTRUCTORS_GROUP = "lab-instructors"
FOLDER_MODE = 0o3753  # rwx root, r-x instructors, -wx learners; setgid, sticky
FILE_MODE = 0o640
#: result -> score in the heat map (and its letter in the table)
SCORES = {"ok": 1.0, "wrong": 0.0, "not yet": 0.5}
LETTERS = {"ok": "+", "wrong": "x", "not yet": "."}


@dataclass(frozen=True)
class Record:
    user: str
    notebook: str
    exercise: str
    result: str  # a key of SCORES
    time: str  # ISO 8601, UTC

    @property
    def key(self) -> str:
        return f"{self.notebook}: {self.exercise}" if self.notebook else self.exercise


def _notebook() -> str:
    """The running notebook's name: Jupyter Server tells its kernels (``JPY_SESSION_NAME``)."""
    session = os.environ.get("JPY_SESSION_NAME", "")
    return Path(session).stem if session.endswith(".ipynb") else ""


def record(exercise: str, result: str) -> Path | None:
    """Append this user's ``result`` for ``exercise``; nothing where no folder is set.

    A failure to write warns and returns None: a learner's check cell never fails for it."""
    folder = os.environ.get(FOLDER_VARIABLE)
    if not folder:
        return None
    if result not in SCORES:
        raise ValueError(f"result {result!r} is not one of {sorted(SCORES)}")
    user = pwd.getpwuid(os.geteuid()).pw_name
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    line = json.dumps(Record(user, _notebook(), exercise, result, now).__dict__) + "\n"
    path = Path(folder) / f"{user}.jsonl"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # the umask (077 for learners) took the group's read bit
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as e:
        warnings.warn(f"progress not recorded in {path}: {e}", stacklevel=2)
        return None
    return path


def read(folder: Path) -> list[Record]:
    """Every record in ``folder`` whose file belongs to the user it is named after.

    Raises PermissionError where the caller may not list ``folder`` (learners); a file its owner
    made unreadable (chmod 600) is left out."""
    records = []
    for name in sorted(os.listdir(folder)):
        path = folder / name
        try:
            owner = pwd.getpwuid(path.stat().st_uid).pw_name
            if path.suffix != ".jsonl" or owner != path.stem:
                continue  # not a results file, or another user's forgery
            lines = path.read_text().splitlines()
        except (KeyError, OSError):
            continue
        for line in lines:
            try:
                rec = Record(**json.loads(line))
            except (TypeError, ValueError):
                continue
            if rec.user == owner and rec.result in SCORES:
                records.append(rec)
    return records


def table(records: Iterable[Record]) -> tuple[list[str], list[str], dict[tuple[str, str], str]]:
    """(learners, exercises in first-seen order, {(learner, exercise): result}); a pass stays a pass."""
    learners: list[str] = []
    exercises: list[str] = []
    cells: dict[tuple[str, str], str] = {}
    for rec in sorted(records, key=lambda r: r.time):
        learners += [rec.user] if rec.user not in learners else []
        exercises += [rec.key] if rec.key not in exercises else []
        if cells.get((rec.user, rec.key)) != "ok":
            cells[rec.user, rec.key] = rec.result
    return sorted(learners), exercises, cells


def text_table(records: Iterable[Record]) -> str:
    learners, exercises, cells = table(records)
    if not learners:
        return "no results yet: none of the learners has run a check cell"
    width = max(len(u) for u in learners)
    lines = [f"{'':{width}}  " + " ".join(f"{i + 1:>2}" for i in range(len(exercises)))]
    for user in learners:
        marks = [LETTERS.get(cells.get((user, ex), ""), " ") for ex in exercises]
        passed = sum(cells.get((user, ex)) == "ok" for ex in exercises)
        lines.append(
            f"{user:{width}}  " + " ".join(f"{m:>2}" for m in marks) + f"   {passed}/{len(exercises)}"
        )
    lines += ["", "+ passed   x wrong so far   . not yet answered", ""]
    lines += [f"{i + 1:>2} {ex}" for i, ex in enumerate(exercises)]
    return "\n".join(lines)


def heat_map(records: Iterable[Record], path: Path | None = None):
    """Learners x exercises (green passed, red wrong, grey not yet); saved to ``path`` if given."""
    import matplotlib.pyplot as plt
    import numpy as np

    learners, exercises, cells = table(records)
    scores = np.full((len(learners), len(exercises)), np.nan)  # (learners, exercises)
    for (user, ex), result in cells.items():
        scores[learners.index(user), exercises.index(ex)] = SCORES[result]
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * len(exercises) + 2), max(2, 0.4 * len(learners) + 1.5)))
    ax.imshow(scores, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_yticks(range(len(learners)), learners)
    ax.set_xticks(range(len(exercises)), [str(i + 1) for i in range(len(exercises))])
    ax.set_xlabel("exercise (numbered as in `./lab progress`)")
    ax.set_title("exercises: passed (green), wrong so far (red), not yet (yellow), not run (white)")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def learners() -> list[str]:
    """The users of the Slurm account ``learners`` (every learner, with results or not)."""
    cmd = ["sacctmgr", "-n", "-P", "show", "assoc", "where", "account=learners", "format=user"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return sorted({u for u in out.stdout.split() if u}) if out.returncode == 0 else []


def jobs(users: Iterable[str]) -> dict[str, list[str]]:
    """Each user's jobs in the queue: ``id name state``, from ``squeue`` (run by an instructor)."""
    names = sorted(set(users))
    if not names:
        return {}
    cmd = ["squeue", "-h", "-u", ",".join(names), "-o", "%u %i %j %T"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    found: dict[str, list[str]] = {u: [] for u in names}
    for line in out.stdout.splitlines():
        user, rest = line.split(" ", 1)
        found.setdefault(user, []).append(rest)
    return found


def default_folder() -> Path:
    from distlab.cluster.config import local_paths

    return Path(os.environ.get(FOLDER_VARIABLE) or local_paths().root / "progress")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab progress", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--folder", type=Path, default=None, help="the progress folder (default: the cluster's)"
    )
    parser.add_argument("--plot", type=Path, default=None, help="write the heat map to this PNG")
    args = parser.parse_args(argv)
    folder = args.folder or default_folder()
    if not folder.is_dir():
        print(f"lab progress: no progress folder {folder}: start a workshop (`sudo ./lab workshop`)")
        return 1
    try:
        records = read(folder)
    except PermissionError as e:
        print(f"lab progress: {e}: only root and the group {INSTRUCTORS_GROUP} may read the results")
        return 1
    print(text_table(records))
    seen = table(records)[0]
    print("\njobs in the queue:")
    for user, queued in jobs([*seen, *learners()]).items():
        print(f"  {user}: {'; '.join(queued) if queued else 'none'}")
    if args.plot and seen:
        heat_map(records, args.plot)
        print(f"heat map: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
