"""Where `./lab test`'s time goes: every test module's and every notebook's seconds, as a table.

Seconds per module = the sum of its tests' times in the junit XML `./lab test` writes for the whole
suite (``.lab/junit/tests.xml``, and ``tests-mostly-waits.xml`` for the tests that run beside them;
each test's setup, call and teardown, so a module-scoped fixture counts once, in its first test);
seconds per notebook and solution from the executed notebooks' index (``.lab/executed/index.json``,
with each one's slowest cells). Wall-clock parts (unit tests, notebooks) come from the same files.

Read the files the last `./lab test` left::

    python benchmarks/test_times.py [--top 40]

Or run the whole of `./lab test` first, beside K busy processes (`./lab soak`'s load: two make a
2-core machine as loaded as CI's with other work beside it), then print the table::

    python benchmarks/test_times.py --run [--load 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from distlab.soak_processes import busy_processes

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / ".lab"


def module_seconds(junit: Path) -> tuple[dict[str, list[float]], float]:
    """``{module: [seconds, tests]}`` from one junit XML file, and the run's wall-clock seconds."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    wall = 0.0
    for suite in suites:
        wall += float(suite.get("time", 0))
        for case in suite.iter("testcase"):
            module = case.get("classname", "").split(".")
            name = "/".join(module[: module.index(next(p for p in module if p.startswith("test_"))) + 1])
            modules[name + ".py"][0] += float(case.get("time", 0))
            modules[name + ".py"][1] += 1
    return dict(modules), wall


def table(state: Path, top: int) -> str:
    """The Markdown table: the parts' wall-clock times, then modules and notebooks, slowest first."""
    rows, parts = [], []
    for part, file in (
        ("unit tests", "tests.xml"),
        ("unit tests marked mostly_waits (beside)", "tests-mostly-waits.xml"),
    ):
        path = state / "junit" / file
        if not path.is_file():
            continue
        modules, wall = module_seconds(path)
        parts.append(
            f"{part}: {wall / 60:.1f} min wall-clock, {sum(n for _, n in modules.values()):.0f} tests"
        )
        rows += [
            (s, f"`{m}`" + (" (beside)" if "waits" in file else ""), f"{n:.0f} tests")
            for m, (s, n) in modules.items()
        ]
    index = state / "executed" / "index.json"
    if index.is_file():
        books = json.loads(index.read_text())
        for folder in ("notebooks", "solutions"):
            mine = {p: e for p, e in books.items() if p.startswith(folder + "/")}
            parts.append(
                f"{folder}: {sum(e['seconds'] for e in mine.values()) / 60:.1f} min, {len(mine)} run"
            )
        for path, entry in books.items():
            slow = ", ".join(
                f"cell {c['cell']} {c['seconds']:.0f} s" for c in entry.get("slowest cells", [])[:2]
            )
            rows.append(
                (entry["seconds"], f"`{path}`", f"{entry['outcome']}; {slow}" if slow else entry["outcome"])
            )
    rows.sort(reverse=True)
    lines = [*(f"- {p}" for p in parts), "", "| seconds | module or notebook | |", "|---:|---|---|"]
    lines += [f"| {s:.1f} | {name} | {what} |" for s, name, what in rows[:top]]
    rest = rows[top:]
    if rest:
        lines.append(f"| {sum(s for s, _, _ in rest):.1f} | the other {len(rest)} | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", action="store_true", help="run `./lab test` (the whole suite) first")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the run (with --run)")
    parser.add_argument("--top", type=int, default=40, help="rows shown; the rest summed in one")
    parser.add_argument("--state", type=Path, default=STATE, help="the .lab folder to read")
    args = parser.parse_args()
    rc = 0
    if args.run:
        start = time.monotonic()
        with busy_processes(args.load):
            rc = subprocess.run([str(ROOT / "lab"), "test"], cwd=ROOT).returncode
        print(
            f"\n`./lab test` beside {args.load} busy processes: {(time.monotonic() - start) / 60:.1f} min, exit {rc}"
        )
    print(table(args.state, args.top))
    return rc


if __name__ == "__main__":
    sys.exit(main())
