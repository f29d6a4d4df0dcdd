"""Each notebook's learner time in minutes, counted from the notebooks, and the tables built from it.

    minutes = reading + job waits + exercises

Reading at 150 words a minute, the job waits measured (``instructor/measured_seconds.json``: the
notebook's and its solution's run time on the 2-core development machine), and a fixed time per
exercise cell: the rules are ``distlab.course_counting``'s docstring. The tracks and the days are
``distlab.course_tracks``'s; the tables ``distlab.course_tables``'s.

Usage::

    python -m distlab.course_minutes            # the table per notebook and per track
    python -m distlab.course_minutes --write    # rewrite the generated tables (see TARGETS)
    python -m distlab.course_minutes --check    # exit 1 when a generated table is out of date
    python -m distlab.course_minutes --record .lab/soak/run-*.xml --source "what, when, where"

``--record`` sets each notebook's measured seconds to its median over the junit XML files (passed
runs only), e.g. those ``./lab soak`` leaves; ``--write`` then carries them into the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from distlab import course_tracks
from distlab.course_counting import NotebookMinutes, count_notebook
from distlab.course_tables import (
    class_plan,
    course_map,
    course_table,
    course_total,
    minutes_markdown,
    notebook_with_blocks,
    replace_block,
    text_table,
)

#: The checkout that holds this package (``distlab.REPO_ROOT`` may name a learner's workspace).
CHECKOUT = Path(__file__).resolve().parents[2]
MEASURED = Path("instructor/measured_seconds.json")
MINUTES_FILE = Path("instructor/minutes.md")


def measured_seconds(root: Path = CHECKOUT) -> dict[str, float]:
    """Path (relative to the checkout) -> measured seconds, from :data:`MEASURED`."""
    data = json.loads((root / MEASURED).read_text())
    return {path: float(entry["seconds"]) for path, entry in data["seconds"].items()}


def solution_of(notebook: Path) -> str:
    """The solution's path (relative to the checkout) of a notebook ``notebooks/NN_name.ipynb``."""
    return f"solutions/{notebook.stem}_solution.ipynb"


def course(root: Path = CHECKOUT) -> list[NotebookMinutes]:
    """Every notebook's minutes, in the notebooks' order. A notebook (or its solution) without a
    measured time raises KeyError saying how to record one."""
    course_tracks.check_plan()
    seconds = measured_seconds(root)
    rows = []
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        rel = f"notebooks/{path.name}"
        missing = [p for p in (rel, solution_of(path)) if p not in seconds]
        if missing:
            raise KeyError(
                f"no measured time for {missing} in {MEASURED}: run `./lab soak {' '.join(missing)}`, then "
                "`python -m distlab.course_minutes --record .lab/soak/run-*.xml --source ...`"
            )
        run = seconds[rel] + seconds[solution_of(path)]
        rows.append(NotebookMinutes(path.name[:2], rel, count_notebook(path), run))
    return rows


#: Each generated file -> its kind and the generated blocks it holds ("file": the whole file is one).
#: Notebook 00 has two blocks, each in a markdown cell of its own: the totals in the cell that
#: introduces the map, the table in the next, so that neither cell is long.
TARGETS = {
    MINUTES_FILE: ("file", ("minutes",)),
    Path("README.md"): ("block", ("course map",)),
    Path("notebooks/00_start_here.ipynb"): ("notebook", ("course total", "course table")),
    Path("instructor/README.md"): ("block", ("class plan",)),
}


def generated(root: Path = CHECKOUT) -> dict[Path, str]:
    """Each of :data:`TARGETS`'s new text."""
    rows = course(root)
    bodies = {
        "minutes": minutes_markdown(rows),
        "course map": course_map(rows),
        "course table": course_table(rows),
        "course total": course_total(rows),
        "class plan": class_plan(rows),
    }
    out = {}
    for rel, (kind, names) in TARGETS.items():
        if kind == "file":
            (name,) = names
            out[rel] = bodies[name]
        elif kind == "notebook":
            out[rel] = notebook_with_blocks(root / rel, {name: bodies[name] for name in names})
        else:
            text = (root / rel).read_text()
            for name in names:
                text = replace_block(text, name, bodies[name])
            out[rel] = text
    return out


def stale(root: Path = CHECKOUT) -> list[Path]:
    """The targets whose text differs from what :func:`generated` makes."""
    return [
        rel
        for rel, text in generated(root).items()
        if not (root / rel).is_file() or (root / rel).read_text() != text
    ]


def write(root: Path = CHECKOUT) -> list[Path]:
    """Rewrite the stale targets; the paths rewritten."""
    changed = []
    for rel, text in generated(root).items():
        path = root / rel
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(rel)
    return changed


def junit_seconds(xmls: Sequence[Path]) -> dict[str, list[float]]:
    """Path (``notebooks/NN_x.ipynb``) -> the seconds of its passed runs in nbmake's junit XML files."""
    out: dict[str, list[float]] = {}
    for xml in xmls:
        for case in ET.parse(xml).getroot().iter("testcase"):
            name, classname = case.get("name", ""), case.get("classname", "")
            if not name.endswith(".ipynb") or any(
                case.find(t) is not None for t in ("failure", "error", "skipped")
            ):
                continue
            folder = classname.split(".")[0]
            out.setdefault(f"{folder}/{name}", []).append(float(case.get("time", "nan")))
    return out


def record(xmls: Sequence[Path], source: str, root: Path = CHECKOUT) -> dict[str, float]:
    """Set the measured seconds of every notebook in ``xmls`` to its median there; what was set."""
    path = root / MEASURED
    data = json.loads(path.read_text())
    medians = {nb: round(statistics.median(times), 1) for nb, times in junit_seconds(xmls).items() if times}
    for nb, seconds in medians.items():
        data["seconds"][nb] = {"seconds": seconds, "source": source}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.course_minutes", description=__doc__.split("\n\n")[0]
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--write", action="store_true", help="rewrite the generated tables that are out of date"
    )
    what.add_argument("--check", action="store_true", help="exit 1 when a generated table is out of date")
    what.add_argument(
        "--record", nargs="+", type=Path, metavar="XML", help="measured seconds from junit XML files"
    )
    parser.add_argument("--source", help="with --record: the runs' description (command, date, machine)")
    args = parser.parse_args(argv)
    if args.record:
        if not args.source:
            parser.error("--record needs --source: say which runs these are (command, date, machine)")
        for nb, seconds in record(args.record, args.source).items():
            print(f"{seconds:7.1f} s  {nb}")
        return 0
    print(text_table(course()))
    if args.write:
        for rel in write():
            print(f"rewrote {rel}")
    elif args.check:
        old = stale()
        for rel in old:
            print(f"out of date: {rel} (run python -m distlab.course_minutes --write)", file=sys.stderr)
        return 1 if old else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
