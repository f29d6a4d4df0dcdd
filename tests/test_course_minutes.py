"""The course's tracks and learner minutes (``distlab.course_tracks``, ``course_counting``, ``course_tables``,
``course_minutes``).

The generated tables (``instructor/minutes.md``, README's and notebook 00's course map, the
instructor guide's class plan) must be what the script makes of the notebooks as they are now, and
the core track must fit its two days. The counting rules are checked on a notebook made here.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from distlab import course_counting as cc
from distlab import course_minutes as cm
from distlab import course_tables, course_tracks

CHECKOUT = Path(cm.__file__).resolve().parents[2]


def test_the_generated_tables_are_up_to_date():
    stale = cm.stale()
    assert not stale, (
        f"out of date: {[str(p) for p in stale]}. The notebooks, the tracks or the measured times changed: "
        "run `python -m distlab.course_minutes --write` and commit the result"
    )


def test_the_core_track_fits_two_days():
    rows = cm.course()
    core = course_tables.track_minutes(rows, course_tracks.CORE)
    assert core <= course_tracks.CORE_LIMIT_MIN, course_tables.text_table(rows)
    assert {r.track for r in rows} == {course_tracks.CORE, course_tracks.DEEP_DIVE}


def test_every_notebook_has_a_track_a_day_and_a_measured_time():
    course_tracks.check_plan()
    numbers = sorted(p.name[:2] for p in (CHECKOUT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert numbers == sorted(course_tracks.TRACK), "add the new notebook to distlab.course_tracks"
    seconds = cm.measured_seconds()
    for p in (CHECKOUT / "notebooks").glob("[0-9][0-9]_*.ipynb"):
        assert f"notebooks/{p.name}" in seconds and cm.solution_of(p) in seconds, p.name


def test_a_plan_that_puts_a_deep_dive_on_a_core_day_is_refused(monkeypatch):
    days = dict(course_tracks.DAYS)
    days["Day 1"] = (*days["Day 1"], "06")
    days["Day 3 (optional)"] = tuple(n for n in days["Day 3 (optional)"] if n != "06")
    monkeypatch.setattr(course_tracks, "DAYS", days)
    with pytest.raises(ValueError, match=r"\['06'\]"):
        course_tracks.check_plan()


def write_notebook(path: Path, cells: list[tuple[str, str]]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(text) if kind == "md" else nbformat.v4.new_code_cell(text)
        for kind, text in cells
    ]
    nbformat.write(nb, path)


def test_the_counting_rules(tmp_path):
    start, end = cc.block_markers("course map")
    path = tmp_path / "99_x.ipynb"
    write_notebook(
        path,
        [
            ("md", "# 99 · A title\n\nSix words, [a link](https://x.y/z) | and |"),  # 8 words
            ("md", f"two words\n\n{start}\n| a | b | c | d |\n{end}"),  # the generated block is not read
            ("code", "from distlab.checks import FIXME\nx = 1  # three comment words\n!echo '# not counted'"),
            ("code", "answer = FIXME   # a value\nb, c = FIXME, FIXME"),  # 3 values
            ("md", "## 2. Exercise: the big one"),
            ("code", "%%writefile jobs/a.sbatch\n#!/bin/bash\n#SBATCH --nodes=#FIXME   # one two\nsrun x"),
            ("code", "%%writefile jobs/b.py\ndef f():\n    raise NotImplementedError"),
            ("code", "def g(x):\n    return FIXME"),
            ("code", "guess = FIXME"),  # one value, but an exercise section's cell: 10 minutes
            (
                "code",
                "check('x', answer if answer else FIXME)\nok = FIXME if job is None else 1",
            ),  # no answer
        ],
    )
    counted = cc.count_notebook(path)
    assert counted.title == "A title"
    # "99", "A", "title" ("·" and "|" hold no letter); "Six", "words,", "[a", "link]", "and"; "two", "words";
    # the heading's "2.", "Exercise:", "the", "big", "one"
    assert counted.prose_words == 3 + 5 + 2 + 5
    assert (
        counted.comment_words == 3 + 2 + 2
    )  # "three comment words", "a value", the #SBATCH line's "one two"
    kinds = [(e.kind, e.values, e.minutes) for e in counted.exercises]
    assert kinds == [
        ("answer", 3, 3 * cc.ANSWER_MIN),
        ("script", 1, cc.COMPLETE_SCRIPT_MIN),
        ("code", 1, cc.WRITE_CODE_MIN),
        ("code", 1, cc.WRITE_CODE_MIN),
        ("answer", 1, cc.EXERCISE_SECTION_MIN),
    ]


def test_record_takes_the_median_of_the_passed_runs(tmp_path):
    (tmp_path / "instructor").mkdir()
    (tmp_path / cm.MEASURED).write_text(json.dumps({"about": "x", "seconds": {}}))
    xmls = []
    for i, (t, failed) in enumerate([(10.0, False), (30.0, False), (20.0, False), (99.0, True)]):
        suite = ET.Element("testsuite")
        case = ET.SubElement(
            suite, "testcase", classname="notebooks.00_a.ipynb", name="00_a.ipynb", time=str(t)
        )
        if failed:
            ET.SubElement(case, "failure", message="boom")
        ET.SubElement(suite, "testcase", classname="tests.test_x", name="test_y", time="1.0")
        xmls.append(tmp_path / f"run-{i}.xml")
        ET.ElementTree(suite).write(xmls[-1])
    assert cm.record(xmls, "three runs", root=tmp_path) == {"notebooks/00_a.ipynb": 20.0}
    saved = json.loads((tmp_path / cm.MEASURED).read_text())["seconds"]
    assert saved == {"notebooks/00_a.ipynb": {"seconds": 20.0, "source": "three runs"}}


def test_a_target_without_its_markers_is_refused():
    with pytest.raises(ValueError, match="no generated block 'course map'"):
        course_tables.replace_block("no markers here", "course map", "table")


def test_the_command_line_checks_and_prints(capsys):
    assert cm.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "core track" in out and "within its limit" in out


def test_notebook_00s_map_is_a_short_table_beside_its_totals():
    """Notebook 00's map is two generated blocks, each in a markdown cell of its own: the totals under
    the prose that introduces the map, and a table of short titles whose day stands for the track.
    Neither cell may pass 200 words, every whitespace-separated token counted (the markers and the
    table's pipes too)."""
    rows = cm.course()
    table = course_tables.course_table(rows)
    assert "| 00 Start here | 1 |" in table and "| 08 PyTorch's own parallel API | 3 |" in table
    for r in rows:
        day = "3" if r.track == course_tracks.DEEP_DIVE else ("1", "2")
        assert any(
            line.startswith(f"| {r.number} ") and line.split(" | ")[1] in day for line in table.splitlines()
        )
    nb = json.loads((CHECKOUT / "notebooks" / "00_start_here.ipynb").read_text())
    for name in ("course total", "course table"):
        start = cc.block_markers(name)[0]
        (cell,) = [c for c in nb["cells"] if start in "".join(c["source"])]
        words = "".join(cell["source"]).split()
        assert len(words) <= 200, f"notebook 00's cell with the {name!r} block has {len(words)} words"


def test_the_short_title_stops_at_a_colon_or_a_semicolon():
    assert course_tables.short_title("Start here: the cluster, a batch job") == "Start here"
    assert course_tables.short_title("Context and expert parallelism; the five dimensions") == (
        "Context and expert parallelism"
    )
    assert course_tables.short_title("Profiling and monitoring") == "Profiling and monitoring"


def test_a_notebooks_blocks_are_rewritten_each_in_its_cell(tmp_path):
    path = tmp_path / "00_x.ipynb"
    (a_start, a_end), (b_start, b_end) = cc.block_markers("a"), cc.block_markers("b")
    write_notebook(path, [("md", f"intro\n{a_start}\nold a\n{a_end}"), ("md", f"{b_start}\nold b\n{b_end}")])
    nb = json.loads(course_tables.notebook_with_blocks(path, {"a": f"{a_start}\nnew a\n{a_end}", "b": "B"}))
    assert ["".join(c["source"]) for c in nb["cells"]] == [f"intro\n{a_start}\nnew a\n{a_end}", "B"]
    with pytest.raises(ValueError, match="0 markdown cells hold the generated block 'c'"):
        course_tables.notebook_with_blocks(path, {"c": "C"})
