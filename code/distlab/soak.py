"""``./lab soak``: run notebooks many times, under load, as ``./lab test`` runs them, and count.

Contract. ``python -m distlab.soak [--runs N] [--load K] [NOTEBOOK ...]`` (what ``./lab soak``
calls after installing and starting what ``./lab test`` does):

* runs the named notebooks (files or folders; default ``notebooks/`` and ``solutions/``) ``N``
  times each. One run of all of them is one call of the ``lab`` script's own ``run_tests`` with
  the notebooks named, i.e. exactly ``./lab test NOTEBOOK ...``: as the learner when root runs it,
  in their test workspace (made anew each run), under nbmake, with the same options and variables.
  Runs are interleaved (run 1 of every notebook, then run 2 ...) so that one run is one real
  ``./lab test``, with what one notebook leaves to the next in the same workspace, and so that
  conditions that drift over the hours (other users' load) spread over every notebook instead of
  falling on all runs of one; an interrupted soak has still run every notebook the same number of
  times, give or take one.
* starts ``K`` busy processes (one core each, pure Python loops) before the first run and stops
  them after the last, also on error, Ctrl-C (SIGINT), SIGTERM and SIGHUP (``try/finally``); each
  also ends itself within a second once this process is gone (SIGKILL included), since it checks
  its parent.
* prints one table: notebook, runs passed / runs, median and max seconds (nbmake's item time, all
  runs), then for each failed run the failing cell (numbered from 0 over every cell, as nbmake and
  the issues count) and its first error line (``AssertionError: ...``). Each run's pytest output
  and junit XML stay in ``.lab/soak/run-<i>.log`` / ``.xml``.
* after each run, cancels the Slurm jobs it left in the test workspace (a notebook stopped
  mid-cell leaves its job holding the nodes that the next run waits for).
* exits 0 when every run passed, 1 when any failed (or gave no result), 128 + the signal's number
  when interrupted (the table of the notebooks that finished, the interrupted run's included, is
  printed first).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from distlab.soak_processes import busy_processes, cancel_left_jobs, stop_run

ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*m")
DASHES = "-" * 75  # nbmake's separator before the failing cell's source
#: an IPython traceback's frame: its header, then its code lines (indented, or ``---->`` for the
#: current line), then the exception's ``Name: message``
FRAME_HEADER = re.compile(r"^\s*(Cell In\[|File |Input In \[)")
CODE_LINE = re.compile(r"^(\s|---->)")
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(:( .*)?)?$")
TIMEOUT_PREVIEW = "Here is a preview of the cell contents:"  # nbclient's CellTimeoutError
PREVIEW_RULE = "-" * 19


class Interrupted(Exception):
    """A signal asked the soak to stop; ``results``: the notebooks the interrupted run finished."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.results: list[Result] = []


@dataclass(frozen=True)
class Result:
    """One notebook's outcome in one run."""

    notebook: str  # its path as named, relative to the checkout
    run: int  # 1-based
    passed: bool
    seconds: float | None  # None: no result (the run ended before it)
    cell: int | None = None  # the failing cell, 0-based over every cell
    error: str = ""  # the failure's first error line


@dataclass(frozen=True)
class Row:
    notebook: str
    passed: int
    runs: int
    median_s: float | None
    max_s: float | None


def notebook_paths(named: Sequence[str], root: Path) -> list[str]:
    """The notebooks to run, relative to ``root``, in the order ``./lab test`` runs them: each
    file as named, each folder's ``*.ipynb`` sorted; none named: ``notebooks/`` then ``solutions/``."""
    found: list[str] = []
    for name in named or ("notebooks", "solutions"):
        path = (root / name).resolve()
        if path.is_dir():
            files = sorted(path.glob("*.ipynb"))
        elif path.suffix == ".ipynb" and path.is_file():
            files = [path]
        else:
            raise SystemExit(f"soak: {name} is neither a notebook nor a folder of notebooks")
        for f in files:
            rel = os.path.relpath(f, root)
            if rel not in found:
                found.append(rel)
    if not found:
        raise SystemExit("soak: no notebooks to run")
    return found


def _plain(text: str) -> str:
    return ANSI.sub("", text)


def first_error_line(trace: str) -> str:
    """The ``Name: message`` line (its first line only) of the last exception in an IPython
    traceback, as nbmake reports it. nbmake's own summary is the traceback's last line, which for
    a message of several lines is not the one that names the error. The exception's line is the
    first line after the last frame (its header ``Cell In[..]`` / ``File ...`` and its indented or
    ``---->`` code lines) that reads ``Name`` or ``Name: ...``; "" if the text has no frame."""
    lines = _plain(trace).splitlines()
    headers = [i for i, line in enumerate(lines) if FRAME_HEADER.match(line)]
    if not headers:
        return ""  # not a cell's traceback (a timeout, nbmake's internal error)
    for line in lines[headers[-1] + 1 :]:
        if line.strip() and not CODE_LINE.match(line) and EXCEPTION_LINE.match(line):
            return line.strip()
    return ""


def failing_cell(trace: str, cells: Sequence[str]) -> int | None:
    """The index of the cell whose source nbmake's failure text shows, among ``cells`` (every
    cell's source, in order), or None. A cell that raised: its source between nbmake's two lines of
    75 dashes. A cell that timed out: nbclient's preview between two lines of 19 dashes, the whole
    source, or for 11 lines or more its first and last 5 lines as Python lists."""
    lines = _plain(trace).splitlines()
    if lines and lines[0] == DASHES and DASHES in lines[1:]:
        source = "\n".join(lines[1 : lines.index(DASHES, 1)])
        return _only([i for i, cell in enumerate(cells) if cell == source])
    if TIMEOUT_PREVIEW in lines and lines[lines.index(TIMEOUT_PREVIEW) + 1 :].count(PREVIEW_RULE) >= 2:
        body = lines[lines.index(TIMEOUT_PREVIEW) + 2 :]
        preview = "\n".join(body[: len(body) - 1 - body[::-1].index(PREVIEW_RULE)])
        exact = [i for i, cell in enumerate(cells) if cell == preview]
        if exact:
            return _only(exact)
        try:
            head = ast.literal_eval(preview.split("\n", 1)[0])
        except (ValueError, SyntaxError):
            return None
        return _only([i for i, cell in enumerate(cells) if cell.strip().split("\n")[:5] == head])
    return None


def _only(found: list[int]) -> int | None:
    return found[0] if len(found) == 1 else None


def cell_sources(notebook: Path) -> list[str]:
    """Every cell's source, as one string each (nbformat's two spellings: a string or lines)."""
    cells = json.loads(notebook.read_text())["cells"]
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells]


def junit_id(path: str) -> str:
    """pytest's junit ``classname`` of nbmake's item for ``path`` (its node id's file part)."""
    return path.replace("/", ".").replace(os.sep, ".")


NO_RESULT = "no result: see the run's log"


def read_junit(xml: Path, notebooks: Sequence[str], run: int, root: Path) -> list[Result]:
    """Each of ``notebooks``'s result in one run's junit XML; one missing from it (the run ended
    first, or pytest could not collect it) failed with no time."""
    cases: dict[str, ET.Element] = {}
    if xml.is_file():
        try:
            for case in ET.parse(xml).getroot().iter("testcase"):
                cases[case.get("classname", "")] = case
        except ET.ParseError:
            pass
    results = []
    for nb in notebooks:
        case = cases.get(junit_id(nb))
        if case is None:
            results.append(Result(nb, run, False, None, None, NO_RESULT))
            continue
        seconds = float(case.get("time", "nan"))
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is None:
            passed = case.find("skipped") is None
            results.append(Result(nb, run, passed, seconds, None, "" if passed else "skipped"))
            continue
        trace = bad.text or ""
        message = _plain(bad.get("message", ""))
        if message == "NBMAKE INTERNAL ERROR":  # e.g. the kernel died: the exception is the next line
            message = " ".join(_plain(trace).splitlines()[:2])
        error = first_error_line(trace) or message
        results.append(Result(nb, run, False, seconds, failing_cell(trace, cell_sources(root / nb)), error))
    return results


def table(results: Sequence[Result], notebooks: Sequence[str]) -> tuple[list[Row], str]:
    """The rows (passed / runs, median and max seconds per notebook) and the printed table, with
    one line per failed run under it."""
    rows = []
    for nb in notebooks:
        mine = [r for r in results if r.notebook == nb]
        times = [r.seconds for r in mine if r.seconds is not None]
        rows.append(
            Row(
                nb,
                sum(r.passed for r in mine),
                len(mine),
                statistics.median(times) if times else None,
                max(times) if times else None,
            )
        )
    width = max([len("notebook"), *(len(nb) for nb in notebooks)])

    def secs(s: float | None) -> str:
        return f"{s:8.1f}" if s is not None else f"{'-':>8}"

    lines = [f"{'notebook':<{width}}  passed  median s     max s"]
    for row in rows:
        lines.append(
            f"{row.notebook:<{width}}  {f'{row.passed}/{row.runs}':>6}  {secs(row.median_s)}  {secs(row.max_s)}"
        )
    failures = [r for r in results if not r.passed]
    if failures:
        lines.append("failures (cells numbered from 0 over every cell):")
        for r in sorted(failures, key=lambda r: (notebooks.index(r.notebook), r.run)):
            where = f"cell {r.cell}" if r.cell is not None else "cell ?"
            lines.append(f"  {r.notebook}, run {r.run}: {where}: {r.error}")
    return rows, "\n".join(lines)


def run_once(
    runner: Sequence[str], notebooks: Sequence[str], run: int, logs: Path, owner: str | None, root: Path
) -> list[Result]:
    """One run: ``runner NOTEBOOK ... --junitxml=FILE`` in its own process group (stopped with
    :func:`stop_run` if this is interrupted), its output in ``logs/run-<run>.log``. The junit
    file is written in a private temporary folder that ``owner`` (the learner, when root runs
    this) may write into, then kept beside the log."""
    scratch = Path(tempfile.mkdtemp(prefix="lab-soak-"))
    try:
        if owner is not None:
            shutil.chown(scratch, owner, owner)
        xml = scratch / "junit.xml"
        with open(logs / f"run-{run}.log", "wb") as log:
            proc = subprocess.Popen(
                [*runner, *notebooks, f"--junitxml={xml}"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=root,
            )
            try:
                rc = proc.wait()
            except Interrupted as stop:
                stop_run(proc)  # pytest, stopped by SIGINT, writes the junit of what it finished
                stop.results = finished_before(xml, read_junit(xml, notebooks, run, root))
                raise
            finally:
                if proc.poll() is None:
                    stop_run(proc)
                if left := cancel_left_jobs(owner):
                    say(f"cancelled the job(s) the run left in the test workspace: {', '.join(left)}")
        if xml.is_file():
            shutil.copyfile(xml, logs / f"run-{run}.xml")
        results = read_junit(xml, notebooks, run, root)
        if rc != 0 and all(r.passed for r in results):
            # pytest failed although every notebook passed (a plugin, a teardown): count it
            results = [
                Result(r.notebook, r.run, False, r.seconds, None, f"pytest exited {rc}") for r in results
            ]
        return results
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def finished_before(xml: Path, results: list[Result]) -> list[Result]:
    """The results of an interrupted run that its interruption did not make: those in its junit
    less the last case when it failed (the notebook the signal stopped; nbmake reports it as an
    internal error, with nothing in it that tells it apart from a real failure)."""
    try:
        cases = list(ET.parse(xml).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        return []
    last = cases[-1].get("classname") if cases else None
    return [r for r in results if r.error != NO_RESULT and (r.passed or junit_id(r.notebook) != last)]


def default_runner(root: Path) -> list[str]:
    """The ``lab`` script's ``run_tests``, sourced: what ``./lab test NOTEBOOK ...`` runs."""
    return ["bash", "-c", 'source "$0" && run_tests "$@"', str(root / "lab")]


def soak(
    notebooks: Sequence[str],
    runs: int,
    load: int,
    runner: Sequence[str],
    logs: Path,
    owner: str | None = None,
    root: Path | None = None,
) -> tuple[list[Result], int | None]:
    """Run ``notebooks`` ``runs`` times (interleaved) beside ``load`` busy processes; returns the
    results and, if a signal stopped it, that signal's number. See the module's docstring."""
    root = root or Path.cwd()
    logs.mkdir(parents=True, exist_ok=True)
    for old in [*logs.glob("run-*.log"), *logs.glob("run-*.xml")]:
        old.unlink()
    results: list[Result] = []

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        # once: a second Ctrl-C while the run is being stopped must not cut the cleanup short
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with busy_processes(load) as procs:
            if procs:
                pids = ", ".join(str(p.pid) for p in procs)
                say(f"{load} busy process{'es' if load > 1 else ''} beside the runs (pids {pids})")
            for run in range(1, runs + 1):
                say(f"run {run}/{runs}: {len(notebooks)} notebook(s), output in {logs / f'run-{run}.log'}")
                start = time.monotonic()
                mine = run_once(runner, notebooks, run, logs, owner, root)
                results += mine
                bad = sum(not r.passed for r in mine)
                say(
                    f"run {run}/{runs} took {time.monotonic() - start:.0f} s: {len(mine) - bad} passed, {bad} failed"
                )
        return results, None
    except Interrupted as stop:
        results += stop.results
        say(
            f"stopped by {signal.Signals(stop.signum).name}: the notebooks that finished follow; the busy processes are stopped"
        )
        return results, stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def say(text: str) -> None:
    print(f"[soak] {text}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./lab soak", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "notebooks", nargs="*", metavar="NOTEBOOK", help="files or folders (default: notebooks solutions)"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each notebook (default 3)")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the runs (default 2)")
    parser.add_argument("--logs", type=Path, default=Path(".lab/soak"), help="each run's log and junit XML")
    parser.add_argument(
        "--learner", help="the user the runs execute as (./lab soak passes it when root runs it)"
    )
    parser.add_argument("--runner", help="a command to run in place of the lab's run_tests (tests use it)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.load < 0:
        parser.error("--runs must be at least 1 and --load at least 0")
    root = Path.cwd()
    books = notebook_paths(args.notebooks, root)
    runner = shlex.split(args.runner) if args.runner else default_runner(root)
    owner = args.learner if args.learner and os.geteuid() == 0 else None
    say(f"{args.runs} run(s) of {len(books)} notebook(s), interleaved, beside {args.load} busy process(es)")
    results, stopped = soak(books, args.runs, args.load, runner, args.logs, owner, root)
    print(table(results, books)[1], flush=True)
    if stopped is not None:
        return 128 + stopped
    return 0 if results and all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
