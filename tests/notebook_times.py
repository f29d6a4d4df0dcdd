"""A pytest plugin that prints how long each notebook and solution took, at the end of the run, and
keeps each executed notebook as HTML.

``./lab test`` loads it (``-p tests.notebook_times``), so CI's log shows every notebook's time
beside its budget (issue 20): a notebook at most 120 s, a solution at most 60 s. Times are those
of nbmake's items (setup, call and teardown), in the order they ran; a time over its budget is
marked, never failed, since a shared machine's timings are noisy.

``--keep-executed DIR`` (``./lab test`` passes ``.lab/executed``) writes each notebook nbmake ran, with
its outputs, as ``DIR/<folder>/<name>.html`` (nbconvert's HTML exporter), a failed one up to its
failing cell too, and ``DIR/index.html``: each page with its outcome, seconds and time. The notebook
is the one nbmake executed, taken from its ``NotebookRun`` while the item runs: nothing runs twice.
"""

from __future__ import annotations

import html
import json
import time
import warnings
from pathlib import Path

import pytest

BUDGET_S = {"notebooks": 120.0, "solutions": 60.0}

_times: dict[str, list] = {}  # path -> [seconds, outcome]
_cells: dict[str, list] = {}  # path -> its slowest cells, [(seconds, cell index, first line)]
SLOWEST_CELLS = 3


def cell_seconds(notebook) -> list[tuple[float, int, str]]:
    """Each executed code cell's seconds, from nbclient's timing metadata (``execution``:
    ``iopub.execute_input`` to ``shell.execute_reply``), slowest first: (seconds, index, first line)."""
    from datetime import datetime

    found = []
    for index, cell in enumerate(notebook.cells):
        timing = cell.get("metadata", {}).get("execution", {})
        start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if cell.get("cell_type") != "code" or not start or not end:
            continue
        seconds = (
            datetime.fromisoformat(end.replace("Z", "+00:00"))
            - datetime.fromisoformat(start.replace("Z", "+00:00"))
        ).total_seconds()
        first = next((line.strip() for line in cell.source.splitlines() if line.strip()), "")
        found.append((round(seconds, 1), index, first[:60]))
    return sorted(found, reverse=True)


def pytest_addoption(parser) -> None:
    parser.getgroup("notebook times").addoption(
        "--keep-executed",
        metavar="DIR",
        default=None,
        help="write each notebook nbmake executed, with its outputs, as DIR/<folder>/<name>.html",
    )


def _kept_path(folder: Path, nodeid: str) -> Path:
    """``notebooks/00_start_here.ipynb::...`` -> ``folder/notebooks/00_start_here.html``."""
    return folder / Path(nodeid.split("::")[0]).with_suffix(".html")


def write_html(notebook, path: Path) -> None:
    """The executed notebook (an ``nbformat.NotebookNode``) as one self-contained HTML page."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(notebook)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """While an nbmake item runs, keep the notebook its ``NotebookRun.execute`` returns (passed or
    failed: nbmake raises only after it returned); afterwards write it as HTML."""
    folder = item.config.getoption("keep_executed")
    if not folder or not getattr(item, "nbmake", False):
        return (yield)
    import nbmake.pytest_items as items

    kept = []
    original = items.NotebookRun

    class KeepingRun(original):
        def execute(self):
            result = super().execute()
            kept.append(result.nb)
            return result

    items.NotebookRun = KeepingRun
    try:
        return (yield)
    finally:
        items.NotebookRun = original
        if kept:
            _cells[item.nodeid.split("::")[0]] = cell_seconds(kept[0])[:SLOWEST_CELLS]
            try:
                write_html(kept[0], _kept_path(Path(folder), item.nodeid))
            except Exception as exc:  # noqa: BLE001 - keeping a copy must never fail the notebook
                warnings.warn(f"could not keep {item.nodeid} as HTML in {folder}: {exc}", stacklevel=1)


def _write_index(folder: Path, path: str, seconds: float, outcome: str) -> None:
    """Record one notebook's outcome in ``folder/index.json`` and rewrite ``folder/index.html``."""
    record = folder / "index.json"
    entries = json.loads(record.read_text()) if record.is_file() else {}
    entries[path] = {
        "outcome": outcome,
        "seconds": round(seconds, 1),
        "finished": time.strftime("%Y-%m-%d %H:%M"),
        "slowest cells": [{"cell": i, "seconds": t, "source": src} for t, i, src in _cells.get(path, [])],
    }
    record.write_text(json.dumps(entries, indent=1) + "\n")
    rows = "\n".join(
        f'<tr><td><a href="{html.escape(str(Path(p).with_suffix(".html")))}">{html.escape(p)}</a></td>'
        f"<td>{html.escape(e['outcome'])}</td><td>{e['seconds']}</td><td>{html.escape(e['finished'])}</td></tr>"
        for p, e in sorted(entries.items())
    )
    (folder / "index.html").write_text(
        "<!doctype html><meta charset=utf-8><title>executed notebooks</title>\n"
        "<h1>Executed notebooks</h1><p>Written by <code>./lab test</code>, each as nbmake ran it.</p>\n"
        f"<table><tr><th>notebook</th><th>outcome</th><th>seconds</th><th>finished</th></tr>\n{rows}\n</table>\n"
    )


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::")[0]
    if not path.endswith(".ipynb"):
        return
    entry = _times.setdefault(path, [0.0, "passed"])
    entry[0] += report.duration
    if report.outcome != "passed" and entry[1] == "passed":
        entry[1] = report.outcome


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After a notebook's setup, call and teardown are reported: its line in the kept pages' index."""
    result = yield
    folder, path = item.config.getoption("keep_executed"), item.nodeid.split("::")[0]
    if folder and path in _times and _kept_path(Path(folder), item.nodeid).is_file():
        try:
            _write_index(Path(folder), path, *_times[path])
        except OSError as exc:
            warnings.warn(f"could not update the index of {folder}: {exc}", stacklevel=1)
    return result


def pytest_terminal_summary(terminalreporter) -> None:
    if not _times:
        return
    terminalreporter.ensure_newline()
    terminalreporter.section("notebook times")
    totals: dict[str, float] = {}
    for path, (seconds, outcome) in _times.items():
        folder = path.split("/")[0]
        totals[folder] = totals.get(folder, 0.0) + seconds
        budget = BUDGET_S.get(folder)
        over = f"  over its {budget:.0f} s budget" if budget and seconds > budget else ""
        shown = "" if outcome == "passed" else f"  {outcome.upper()}"
        terminalreporter.write_line(f"{seconds:6.1f} s  {path}{shown}{over}")
        for cell_s, index, source in _cells.get(path, []):
            terminalreporter.write_line(f"{'':10}cell {index:>2}: {cell_s:5.1f} s  {source}")
    sums = (f"{folder} {seconds:.0f} s ({seconds / 60:.1f} min)" for folder, seconds in totals.items())
    terminalreporter.write_line("in all: " + ", ".join(sums))
    kept = terminalreporter.config.getoption("keep_executed")
    if kept:
        terminalreporter.write_line(f"executed notebooks as HTML: {Path(kept).resolve() / 'index.html'}")
