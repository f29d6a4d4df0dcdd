"""``./lab soak`` (distlab.soak): real nbmake runs of tiny notebooks generated here, a real soak in
a subprocess (exit status, table, busy processes stopped), and a soak stopped by SIGINT, SIGTERM and
SIGKILL mid-run with its busy processes gone afterwards. The lab's own runner (run_tests as the
learner) is what `./lab soak` adds on top; these tests give the module a plain nbmake command."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from distlab import soak

GOOD = ["# a notebook that passes", "x = 1"]
#: cell 3 fails with a message of two lines: nbmake's summary is the second, the error line the first
BAD = [
    "# a failing notebook",
    "x = 1",
    "some prose",
    "def f():\n    assert x == 2, 'x is 1\\nsecond line'\nf()",
]
SLOW = ["# a cell that outlives the timeout", "x = 1", "import time\ntime.sleep(120)"]
TIMEOUT_S = 4  # nbmake's per-cell timeout in these runs: SLOW's cell 2 times out, the others do not


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(c)
        if c.startswith("#") or c == "some prose"
        else nbformat.v4.new_code_cell(c)
        for c in cells
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def books(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("soak")
    for name, cells in (("good", GOOD), ("bad", BAD), ("slow", SLOW)):
        write_notebook(folder / f"{name}.ipynb", cells)
    return folder


def runner(folder: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--nbmake",
        f"--nbmake-timeout={TIMEOUT_S}",
        f"--rootdir={folder}",
    ]


@pytest.fixture(scope="module")
def junit(books: Path) -> Path:
    """One real nbmake run of the three notebooks, its junit XML."""
    xml = books / "junit.xml"
    names = ["good.ipynb", "bad.ipynb", "slow.ipynb"]
    out = subprocess.run(
        [*runner(books), *names, f"--junitxml={xml}"], cwd=books, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1, out.stdout[-3000:]  # pytest: some tests failed
    return xml


def test_failures_are_read_from_nbmakes_junit(books, junit):
    good, bad, slow, missing = soak.read_junit(
        junit, ["good.ipynb", "bad.ipynb", "slow.ipynb", "gone.ipynb"], 1, books
    )
    assert good.passed and good.cell is None and good.error == "" and good.seconds > 0
    assert not bad.passed and bad.cell == 3
    # the error's first line, not nbmake's summary (the traceback's last line, "second line")
    assert bad.error == "AssertionError: x is 1"
    assert not slow.passed and slow.cell == 2
    assert slow.error == f"A cell timed out while it was being executed, after {TIMEOUT_S} seconds."
    assert not missing.passed and missing.seconds is None and "no result" in missing.error


def test_the_table_counts_runs_and_times(books, junit):
    names = ["good.ipynb", "bad.ipynb"]
    first = soak.read_junit(junit, names, 1, books)
    second = [soak.Result("good.ipynb", 2, True, 10.0), soak.Result("bad.ipynb", 2, True, 1.0)]
    third = [
        soak.Result("good.ipynb", 3, True, 30.0),
        soak.Result("bad.ipynb", 3, False, None, None, "no result"),
    ]
    rows, text = soak.table([*first, *second, *third], names)
    good, bad = rows
    assert (good.passed, good.runs, good.median_s, good.max_s) == (3, 3, 10.0, 30.0)
    assert (bad.passed, bad.runs) == (1, 3)
    assert bad.median_s == pytest.approx((first[1].seconds + 1.0) / 2)  # the run without a time is left out
    assert re.search(r"^good\.ipynb\s+3/3\s+10\.0\s+30\.0$", text, re.M), text
    assert re.search(r"^bad\.ipynb\s+1/3\s", text, re.M), text
    assert "  bad.ipynb, run 1: cell 3: AssertionError: x is 1" in text
    assert "  bad.ipynb, run 3: cell ?: no result" in text


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return found


def start_soak(books: Path, logs: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "distlab.soak",
        "--logs",
        str(logs),
        "--runner",
        " ".join(runner(books)),
        *args,
    ]
    return subprocess.Popen(cmd, cwd=books, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def load_pids(line: str) -> list[int]:
    match = re.search(r"\(pids ([\d, ]+)\)", line)
    assert match, line
    return [int(p) for p in match.group(1).split(", ")]


def test_a_soak_with_a_failure_prints_the_table_exits_1_and_stops_its_load(books, tmp_path):
    proc = start_soak(books, tmp_path, "--runs", "2", "--load", "1", "bad.ipynb")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    load = load_pids(out)
    assert len(load) == 1 and not any(alive(p) for p in load), "a busy process outlived the soak"
    assert re.search(r"^bad\.ipynb\s+0/2\s", out, re.M), out
    assert "bad.ipynb, run 1: cell 3: AssertionError: x is 1" in out, out
    assert "bad.ipynb, run 2: cell 3: AssertionError: x is 1" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-1.log", "run-1.xml", "run-2.log", "run-2.xml"]


def test_a_soak_that_passes_exits_0(books, tmp_path):
    proc = start_soak(books, tmp_path, "--runs", "1", "--load", "0", "good.ipynb")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert re.search(r"^good\.ipynb\s+1/1\s", out, re.M) and "failures" not in out, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_an_interrupted_soak_stops_its_load_and_its_run(books, tmp_path, sig):
    proc = start_soak(books, tmp_path, "--runs", "3", "--load", "2", "slow.ipynb")
    load: list[int] = []
    run: list[int] = []
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "pids" in line:
                load = load_pids(line)
            if "run 1/3:" in line:
                break
        assert len(load) == 2 and all(alive(p) for p in load), "".join(lines)
        deadline = time.monotonic() + 30  # the line is printed just before the run starts
        while not run and time.monotonic() < deadline:
            run = [p for p in children(proc.pid) if p not in load]
            time.sleep(0.05)
        assert len(run) == 1, (run, load)
        deadline = time.monotonic() + 60  # the run's pytest starts the notebook's kernel
        while (
            len(family := psutil.Process(run[0]).children(recursive=True)) < 1 and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        time.sleep(1)
        family = psutil.Process(run[0]).children(recursive=True)
        kernels = [p.pid for p in family if os.getsid(p.pid) != os.getsid(run[0])]
        assert kernels or sig == signal.SIGKILL, [p.cmdline() for p in family]
        proc.send_signal(sig)
        out = proc.communicate(timeout=60)[0]
        if sig == signal.SIGKILL:
            # nothing could clean up: each busy process sees its parent gone and ends by itself
            deadline = time.monotonic() + 10
            while any(alive(p) for p in load) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(alive(p) for p in load), "the busy processes outlived a killed soak"
            return
        assert proc.returncode == 128 + sig, out
        # gone when the soak has exited, not later
        assert not any(alive(p) for p in load), f"busy processes {load} outlived the soak"
        with pytest.raises(ProcessLookupError):
            os.killpg(run[0], 0)  # the run's whole process group (bash/pytest) is stopped too
        # and the notebook's kernel, which Jupyter starts in a session of its own
        assert not any(alive(p) for p in kernels), f"kernels {kernels} outlived the soak"

        assert f"stopped by {sig.name}" in out and re.search(r"^slow\.ipynb\s+0/0\s", out, re.M), out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pgid in run:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_notebooks_are_named_in_the_order_lab_test_runs_them(books, tmp_path):
    (books / "sub").mkdir(exist_ok=True)
    write_notebook(books / "sub" / "b.ipynb", GOOD)
    write_notebook(books / "sub" / "a.ipynb", GOOD)
    assert soak.notebook_paths(["slow.ipynb", "sub", "sub/a.ipynb"], books) == [
        "slow.ipynb",
        "sub/a.ipynb",
        "sub/b.ipynb",
    ]
    with pytest.raises(SystemExit):
        soak.notebook_paths(["nothing.ipynb"], books)


def test_an_interrupted_run_keeps_the_notebooks_it_finished(books, tmp_path):
    proc = start_soak(books, tmp_path, "--runs", "2", "--load", "0", "good.ipynb", "slow.ipynb")
    try:
        log = tmp_path / "run-1.log"
        deadline = time.monotonic() + 120  # good.ipynb's result line, then slow.ipynb's first cell
        while time.monotonic() < deadline and not (log.is_file() and "good.ipynb ." in log.read_text()):
            time.sleep(0.2)
        assert "good.ipynb ." in log.read_text(), log.read_text()
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, out
    assert re.search(r"^good\.ipynb\s+1/1\s", out, re.M), out  # run 1's, though run 1 did not end
    assert re.search(r"^slow\.ipynb\s+0/0\s", out, re.M), out  # stopped mid-run: no result


@pytest.mark.mostly_waits
def test_the_jobs_a_run_left_in_the_workspace_are_cancelled(slurm_cluster, tmp_path):
    workspace, elsewhere = tmp_path / "distlab-course-test", tmp_path / "other"
    (workspace / "notebooks").mkdir(parents=True)
    elsewhere.mkdir()
    os.chmod(tmp_path, 0o755)

    def submit(folder: Path) -> str:
        out = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={folder}", "--time=5", "--wrap", "sleep 300"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return out.stdout.strip().split(";")[0]

    left, kept = submit(workspace / "notebooks"), submit(elsewhere)
    try:
        assert soak.cancel_left_jobs(None, workspace) == [left]
        queued = subprocess.run(
            ["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30
        ).stdout
        assert left not in queued.split() and kept in queued.split(), queued
    finally:
        subprocess.run(["scancel", left, kept], check=False, timeout=30)
