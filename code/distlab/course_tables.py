"""The course's tables, made from each notebook's minutes (``distlab.course_counting``): the printed
table, ``instructor/minutes.md``, README's course map and notebook 00's shorter one, and the
instructor guide's class plan; and the generated blocks they fill (:func:`replace_block`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from distlab.course_counting import (
    ANSWER_MIN,
    COMPLETE_SCRIPT_MIN,
    EXERCISE_SECTION_MIN,
    WORDS_PER_MINUTE,
    WRITE_CODE_MIN,
    NotebookMinutes,
    block_markers,
)
from distlab.course_tracks import CORE, CORE_LIMIT_MIN, DAYS, DEEP_DIVE

#: the class plan's clock: a day starts at 09:00; each notebook gets the instructor's introduction
#: and live demonstration before the learners start; a break before a notebook once this much has run
#: since the last pause, lunch before the first notebook that would start at 12:00 or later, or end after 13:00
DAY_START_MIN = 9 * 60
INTRO_MIN = 10
BREAK_MIN, BREAK_AFTER_MIN = 15, 75
LUNCH_MIN, LUNCH_FROM_MIN, LUNCH_BY_MIN = 60, 12 * 60, 13 * 60
WRAP_UP_MIN = 15


def track_minutes(rows: Sequence[NotebookMinutes], track: str) -> float:
    return sum(r.total for r in rows if r.track == track)


def hours(minutes: float) -> str:
    """``605`` -> ``"10 h 05"``."""
    m = round(minutes)
    return f"{m // 60} h {m % 60:02d}"


def _f(minutes: float) -> str:
    return f"{minutes:.0f}"


def text_table(rows: Sequence[NotebookMinutes]) -> str:
    """The table this module prints: per notebook, then per track."""
    out = [f"{'notebook':<38} {'track':<9} {'read':>5} {'jobs':>5} {'exer':>5} {'total':>6}  (minutes)"]
    for r in rows:
        name = Path(r.path).stem
        out.append(
            f"{name:<38} {r.track:<9} {_f(r.reading):>5} {_f(r.jobs):>5} {_f(r.exercises):>5} {_f(r.total):>6}"
        )
    out.append("")
    for track in (CORE, DEEP_DIVE):
        mine = [r for r in rows if r.track == track]
        parts = [sum(getattr(r, a) for r in mine) for a in ("reading", "jobs", "exercises", "total")]
        out.append(
            f"{track + ' track':<48} {_f(parts[0]):>5} {_f(parts[1]):>5} {_f(parts[2]):>5} {_f(parts[3]):>6}"
            f"  = {hours(parts[3])}"
        )
    core = track_minutes(rows, CORE)
    verdict = "within" if core <= CORE_LIMIT_MIN else "OVER"
    out.append(f"core track {hours(core)}: {verdict} its limit of {hours(CORE_LIMIT_MIN)}")
    return "\n".join(out)


def minutes_markdown(rows: Sequence[NotebookMinutes]) -> str:
    """The whole of ``instructor/minutes.md``."""
    start, end = block_markers("minutes")
    lines = [
        start,
        "# Learner minutes per notebook",
        "",
        f"Counted by `python -m distlab.course_minutes` from the notebooks: reading at {WORDS_PER_MINUTE} words "
        "a minute, the measured job waits, and the exercises. The rules are `distlab.course_counting`'s docstring; in short:",
        "",
        f"* **reading**: the markdown cells' words, plus the code comments' words at half weight, / {WORDS_PER_MINUTE};",
        "* **jobs**: the measured run time of the notebook and of its solution (which runs the exercises' jobs), "
        "top to bottom as `./lab test` runs them on the 2-core development machine, with two busy processes "
        "beside (`./lab soak --load 2`: a shared machine's pace); `instructor/measured_seconds.json` names "
        "each figure's run;",
        f"* **exercises**: {WRITE_CODE_MIN:.0f} minutes per piece of code to write, {COMPLETE_SCRIPT_MIN:.0f} per "
        f"batch script to complete, {ANSWER_MIN:.0f} per value to fill in (at least {EXERCISE_SECTION_MIN:.0f} "
        "per cell of an Exercise section).",
        "",
        "| notebook | track | day | words | reading | jobs | exercises (code / scripts / values) | minutes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kinds = [
            sum(e.values for e in r.counted.exercises if e.kind == k) for k in ("code", "script", "answer")
        ]
        words = r.counted.prose_words + r.counted.comment_words
        lines.append(
            f"| `{Path(r.path).stem}` | {r.track} | {r.day} | {words:,} | {_f(r.reading)} | {_f(r.jobs)} | "
            f"{_f(r.exercises)} ({kinds[0]} / {kinds[1]} / {kinds[2]}) | **{_f(r.total)}** |"
        )
    lines += [
        "",
        "| track | notebooks | reading | jobs | exercises | minutes | hours |",
        "|---|---|---|---|---|---|---|",
    ]
    for track in (CORE, DEEP_DIVE):
        mine = [r for r in rows if r.track == track]
        sums = [sum(getattr(r, a) for r in mine) for a in ("reading", "jobs", "exercises", "total")]
        numbers = ", ".join(r.number for r in mine)
        lines.append(
            f"| {track} | {numbers} | {_f(sums[0])} | {_f(sums[1])} | {_f(sums[2])} | **{_f(sums[3])}** | "
            f"{hours(sums[3])} |"
        )
    core = track_minutes(rows, CORE)
    lines += [
        "",
        f"The core track's limit is {hours(CORE_LIMIT_MIN)} of learner time (two days); it takes {hours(core)}.",
        end,
        "",
    ]
    return "\n".join(lines)


def course_map(rows: Sequence[NotebookMinutes]) -> str:
    """README's map: each notebook, its track, its day and its minutes (notebook 00's: :func:`course_table`)."""
    start, end = block_markers("course map")
    lines = [start, "| notebook | track | day | minutes |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.number} · {r.title} | {r.track} | {r.day} | {_f(r.total)} |")
    core, deep = track_minutes(rows, CORE), track_minutes(rows, DEEP_DIVE)
    lines += [
        "",
        f"Core track {hours(core)}, deep dives {hours(deep)} of learner time: reading at {WORDS_PER_MINUTE} words a "
        "minute, the measured job waits and the exercises (`instructor/minutes.md`).",
        end,
    ]
    return "\n".join(lines)


def short_title(title: str) -> str:
    """A notebook's title up to its first colon or semicolon: ``"Start here: the cluster, ..."`` ->
    ``"Start here"``."""
    return re.split(r"[:;]", title)[0].strip()


def course_table(rows: Sequence[NotebookMinutes]) -> str:
    """Notebook 00's map: each notebook with its short title, its day's number and its minutes. The day
    stands for the track (the deep dives fill the last day, :func:`distlab.course_tracks.check_plan`
    makes sure), and the totals are :func:`course_total`'s, in the cell before: a short cell."""
    start, end = block_markers("course table")
    lines = [start, "| notebook | day | minutes |", "|---|---|---|"]
    for r in rows:
        day = r.day.split()[1] if r.day.startswith("Day ") else r.day  # "Day 3 (optional)" -> "3"
        lines.append(f"| {r.number} {short_title(r.title)} | {day} | {_f(r.total)} |")
    return "\n".join([*lines, end])


def course_total(rows: Sequence[NotebookMinutes]) -> str:
    """The sentence under notebook 00's map: each track's learner time, and how it is counted."""
    start, end = block_markers("course total")
    core, deep = track_minutes(rows, CORE), track_minutes(rows, DEEP_DIVE)
    return "\n".join(
        [
            start,
            f"Core track {hours(core)}, deep dives {hours(deep)} of learner time: reading at {WORDS_PER_MINUTE} "
            "words a minute, the measured job waits and the exercises (`instructor/minutes.md`).",
            end,
        ]
    )


def _clock(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _round5(minutes: float) -> int:
    return int(5 * math.ceil(minutes / 5))


def class_plan(rows: Sequence[NotebookMinutes]) -> str:
    """The guide's timetable: each day's notebooks with clock times, breaks and lunch."""
    start, end = block_markers("class plan")
    by_number = {r.number: r for r in rows}
    core, deep = track_minutes(rows, CORE), track_minutes(rows, DEEP_DIVE)
    lines = [
        start,
        f"Learner time: core track {hours(core)} (its limit {hours(CORE_LIMIT_MIN)}), deep dives {hours(deep)}.",
        "",
    ]
    for day, numbers in DAYS.items():
        mine = [by_number[n] for n in numbers if n in by_number]
        learner = sum(r.total for r in mine)
        lines += [
            f"**{day}**: learner time {hours(learner)}.",
            "",
            "| time | what | learner minutes |",
            "|---|---|---|",
        ]
        clock, since_pause, lunch = DAY_START_MIN, 0, False
        for r in mine:
            slot = _round5(INTRO_MIN + r.total)
            if not lunch and (clock >= LUNCH_FROM_MIN or clock + slot > LUNCH_BY_MIN):
                lines.append(f"| {_clock(clock)} | lunch | |")
                clock, since_pause, lunch = clock + LUNCH_MIN, 0, True
            elif since_pause >= BREAK_AFTER_MIN:
                lines.append(f"| {_clock(clock)} | break | |")
                clock, since_pause = clock + BREAK_MIN, 0
            lines.append(f"| {_clock(clock)} | {r.number} · {r.title} | {_f(r.total)} |")
            clock, since_pause = clock + slot, since_pause + slot
        lines += [
            f"| {_clock(clock)} | questions, wrap-up | |",
            f"| {_clock(clock + WRAP_UP_MIN)} | end | |",
            "",
        ]
    lines += [
        f"Each notebook's slot is its learner minutes plus {INTRO_MIN} for your introduction and live "
        f"demonstration, rounded up to 5 minutes; a {BREAK_MIN}-minute break comes before a notebook once "
        f"{BREAK_AFTER_MIN} minutes have run since the last pause, lunch before the first notebook that starts at "
        "noon or later, or would end after 13:00.",
        end,
    ]
    return "\n".join(lines)


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the generated block ``name`` (its markers included) replaced by ``body``."""
    start, end = block_markers(name)
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"no generated block {name!r} (its marker lines {start!r} ... {end!r})")
    return text[:i] + body + text[j + len(end) :]


def notebook_with_blocks(path: Path, bodies: dict[str, str]) -> str:
    """The notebook file's text with each generated block ``name`` of ``bodies`` replaced by its body, in
    the one markdown cell that holds it; in the repository's notebook format (JSON, indent 1, non-ASCII
    kept)."""
    nb = json.loads(path.read_text())
    for name, body in bodies.items():
        start = block_markers(name)[0]
        cells = [c for c in nb["cells"] if c["cell_type"] == "markdown" and start in "".join(c["source"])]
        if len(cells) != 1:
            raise ValueError(f"{path}: {len(cells)} markdown cells hold the generated block {name!r}, not 1")
        text = replace_block("".join(cells[0]["source"]), name, body)
        cells[0]["source"] = text.splitlines(keepends=True)
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
