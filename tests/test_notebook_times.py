"""``tests/notebook_times.py``'s ``--keep-executed``: a real nbmake run of two tiny notebooks made here
(the course's notebooks need the cluster) keeps each, as nbmake executed it, as an HTML page with its
outputs, the failed one up to its error, and an index with each outcome; without the option nothing
is written. ``./lab test`` passes the option on both of its paths (as the caller, as the learner)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
#: the outputs are not in the sources (a page without outputs would not pass for one with them)
GOOD = [
    "# a notebook that passes",
    "print('printed by' + ' the good notebook')",
    "import time\ntime.sleep(1.5)  # the slowest cell",
]
BAD = [
    "# a notebook that fails",
    "x = 1",
    "assert x == 2, 'x is one, ' + 'not two'",
    "print('never' + ' printed')",
]


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(c) if c.startswith("#") else nbformat.v4.new_code_cell(c) for c in cells
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def nbmake(folder: Path, *options: str) -> subprocess.CompletedProcess:
    books = folder / "notebooks"
    books.mkdir(exist_ok=True)
    write_notebook(books / "good.ipynb", GOOD)
    write_notebook(books / "bad.ipynb", BAD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHECKOUT), str(CHECKOUT / "code")])}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.notebook_times",
        "--nbmake",
    ]
    command += [f"--rootdir={folder}", *options, "notebooks/good.ipynb", "notebooks/bad.ipynb"]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def kept(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("kept")
    out = nbmake(folder, "--keep-executed", str(folder / "executed"))
    return folder / "executed", out


def test_each_executed_notebook_is_kept_as_html(kept):
    executed, out = kept
    assert out.returncode == 1, out.stdout[-3000:]  # the bad notebook failed, as it should
    good = (executed / "notebooks" / "good.html").read_text()
    assert "printed by the good notebook" in good
    bad = (executed / "notebooks" / "bad.html").read_text()
    assert "x is one, not two" in bad and "AssertionError" in bad  # up to its error, traceback included
    assert "never printed" not in bad
    assert f"executed notebooks as HTML: {executed.resolve() / 'index.html'}" in out.stdout
    assert re.search(r"cell  2: +\d+\.\d s  import time", out.stdout), out.stdout  # the slowest cell, shown


def test_the_index_lists_each_page_with_its_outcome(kept):
    executed, _ = kept
    entries = json.loads((executed / "index.json").read_text())
    assert {p: e["outcome"] for p, e in entries.items()} == {
        "notebooks/good.ipynb": "passed",
        "notebooks/bad.ipynb": "failed",
    }
    slowest = entries["notebooks/good.ipynb"]["slowest cells"]
    assert slowest[0]["cell"] == 2 and 1.5 <= slowest[0]["seconds"] < 30, slowest
    assert slowest[0]["source"] == "import time" and slowest[1]["seconds"] < 1.5, slowest
    index = (executed / "index.html").read_text()
    assert 'href="notebooks/good.html"' in index and 'href="notebooks/bad.html"' in index


def test_without_the_option_nothing_is_kept(tmp_path):
    out = nbmake(tmp_path)
    assert out.returncode == 1 and "notebook times" in out.stdout
    assert not list(tmp_path.rglob("*.html")) and "executed notebooks as HTML" not in out.stdout


def test_lab_test_keeps_them_on_both_paths():
    """run_tests in ``./lab``: as the caller and as the learner, nbmake runs with --keep-executed."""
    lab = (CHECKOUT / "lab").read_text()
    runs = [line for line in lab.splitlines() if "--nbmake " in line and "pytest" in line]
    assert len(runs) == 2 and all('--keep-executed "$kept"' in line for line in runs), runs
    assert 'local kept="$STATE/executed"' in lab
