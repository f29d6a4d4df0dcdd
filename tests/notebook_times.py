"""A pytest plugin that prints how long each notebook and solution took, at the end of the run.

``./lab test`` loads it (``-p tests.notebook_times``), so CI's log shows every notebook's time
beside its budget (issue 20): a notebook at most 120 s, a solution at most 60 s. Times are those
of nbmake's items (setup, call and teardown), in the order they ran; a time over its budget is
marked, never failed, since a shared machine's timings are noisy.
"""

from __future__ import annotations

BUDGET_S = {"notebooks": 120.0, "solutions": 60.0}

_times: dict[str, list] = {}  # path -> [seconds, outcome]


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::")[0]
    if not path.endswith(".ipynb"):
        return
    entry = _times.setdefault(path, [0.0, "passed"])
    entry[0] += report.duration
    if report.outcome != "passed" and entry[1] == "passed":
        entry[1] = report.outcome


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
    sums = (f"{folder} {seconds:.0f} s ({seconds / 60:.1f} min)" for folder, seconds in totals.items())
    terminalreporter.write_line("in all: " + ", ".join(sums))
