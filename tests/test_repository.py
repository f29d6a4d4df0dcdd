"""The repository's own conventions: one set of pins, clean notebooks, lint, ignored outputs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from distlab import REPO_ROOT
from distlab.course_counting import prose_words


def pins(lines: list[str]) -> dict[str, str]:
    found = {}
    for line in lines:
        m = re.match(r"^\s*(?:-\s+)?([A-Za-z0-9_.\-]+)==([^\s#]+)", line)
        if m:
            found[m.group(1).lower()] = m.group(2)
    return found


def test_environment_yml_pins_match_requirements():
    req = pins((REPO_ROOT / "requirements.txt").read_text().splitlines())
    env = pins((REPO_ROOT / "environment.yml").read_text().splitlines())
    assert req, "requirements.txt pins nothing"
    assert env == req, f"environment.yml and requirements.txt disagree: {set(env.items()) ^ set(req.items())}"


def notebooks() -> list:
    return sorted([*REPO_ROOT.glob("notebooks/*.ipynb"), *REPO_ROOT.glob("solutions/*.ipynb")])


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
def test_notebook_is_committed_clean(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert not [c for c in code if c.get("outputs") or c.get("execution_count")], "strip the outputs"
    assert set(nb["metadata"]) <= {"kernelspec", "language_info"}, f"extra metadata {set(nb['metadata'])}"
    if path.parent.name == "notebooks":
        assert "jobs.setup_notebook()" in "".join(code[0]["source"]), "first cell: jobs.setup_notebook()"


#: What belongs in README and docstrings, not in a learner's prose: test files, commit ids.
NOT_PROSE = re.compile(r"\btest_\w+\.py\b|\btests/|\bcommit [0-9a-f]{7,}|\bat [0-9a-f]{10}\b")


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
def test_notebook_prose_names_no_test_file_or_commit(path):
    cells = json.loads(path.read_text())["cells"]
    found = [(i, m.group()) for i, c in enumerate(cells) if c["cell_type"] == "markdown"
             for m in NOT_PROSE.finditer("".join(c["source"]))]  # fmt: skip
    assert not found, f"markdown cells naming tests or commits (cell, text): {found}"


#: The course's limit on a markdown cell (issue 44: aim at about 150 words, never over 200).
MAX_CELL_WORDS = 200


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
def test_notebook_markdown_cells_are_short(path):
    cells = json.loads(path.read_text())["cells"]
    long = [(i, n) for i, c in enumerate(cells) if c["cell_type"] == "markdown"
            and (n := prose_words("".join(c["source"]))) > MAX_CELL_WORDS]  # fmt: skip
    assert not long, f"markdown cells over {MAX_CELL_WORDS} words (cell, words): {long}; split them"


def test_every_notebook_links_the_glossary_in_its_first_cell():
    assert (REPO_ROOT / "notebooks" / "GLOSSARY.md").is_file()
    for path in REPO_ROOT.glob("notebooks/*.ipynb"):
        first = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
        assert "[glossary](GLOSSARY.md)" in "".join(first["source"]), f"{path.name}: no glossary link"


def test_every_notebook_is_numbered_and_solutions_match():
    names = [p.stem for p in REPO_ROOT.glob("notebooks/*.ipynb")]
    assert all(re.match(r"^\d\d_", n) for n in names), names
    for sol in REPO_ROOT.glob("solutions/*.ipynb"):
        assert any(sol.stem.startswith(n[:3]) for n in names), f"{sol.name} solves no notebook"


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(REPO_ROOT / ".venv" / "bin" / "ruff")
    folders = [d for d in ("code", "tests", "benchmarks") if (REPO_ROOT / d).is_dir()]
    out = subprocess.run([ruff, "check", *folders], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


def test_generated_folders_are_ignored():
    probe = [
        "notebooks/jobs/x.out",
        "solutions/jobs/x.sbatch",
        "data/cifar-10-batches-py/data_batch_1",
        "runs/tb/events",
        ".lab/cluster/slurm.conf",
        ".venv/bin/python",
        "notebooks/flight_recorder_12/rank_0",
        "flight_recorder/started_0.json",
    ]
    out = subprocess.run(["git", "check-ignore", *probe], cwd=REPO_ROOT, capture_output=True, text=True)
    assert sorted(out.stdout.split()) == sorted(probe)


def test_every_module_and_script_imports():
    """Catches a name removed from the library but still imported by a script nobody ran."""
    import importlib
    import importlib.util
    import pkgutil

    import distlab

    for mod in pkgutil.walk_packages(distlab.__path__, "distlab."):
        if not mod.name.endswith("__main__"):
            importlib.import_module(mod.name)
    for path in [*REPO_ROOT.glob("code/*.py"), *REPO_ROOT.glob("benchmarks/*.py")]:
        spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))  # guarded by __main__
