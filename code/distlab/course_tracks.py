"""The course's two tracks and its days, in one place.

The **core track** is what an instructor teaches in two days: at most :data:`CORE_LIMIT_MIN` minutes
of learner time (reading, the measured job waits and the exercises, as ``distlab.course_minutes``
counts them; its table is ``instructor/minutes.md``). The **deep dives** fill an optional third day.

Why this split (the minutes are in ``instructor/minutes.md``):

* 00-05 and 07 are the path every later notebook stands on: the cluster and its commands, a node's
  topology, collectives, DDP, Megatron-style data, tensor and pipeline parallelism, and memory.
* 10 (fault tolerance) and 13 (plan before you pay) are what a learner needs first on a real
  cluster, and both fit under the limit. Should the core grow past it, 13 moves to the deep dives
  first: it stands alone, while the deep dive 12 builds on 10.
* 06, 08, 09, 11 and 12 deepen what the core built (profiling, PyTorch's own API, context and expert
  parallelism, Llama and Mixtral, hangs): each stands on the core alone, so a class may take any of
  them, in any order, on the optional day.

``README.md``, notebook 00 and the instructor guide show this map; ``python -m
distlab.course_minutes --write`` rewrites their tables from here.
"""

from __future__ import annotations

CORE = "core"
DEEP_DIVE = "deep dive"
TRACKS = (CORE, DEEP_DIVE)

CORE_LIMIT_MIN = 600.0
"""The core track's learner time at most: two days of about five hours each."""

#: Each notebook's number -> its track. A new notebook must be added here (a test says so).
TRACK = {
    "00": CORE,
    "01": CORE,
    "02": CORE,
    "03": CORE,
    "04": CORE,
    "05": CORE,
    "06": DEEP_DIVE,
    "07": CORE,
    "08": DEEP_DIVE,
    "09": DEEP_DIVE,
    "10": CORE,
    "11": DEEP_DIVE,
    "12": DEEP_DIVE,
    "13": CORE,
}

#: The class's days, each a sequence of notebook numbers in the order taught.
DAYS = {
    "Day 1": ("00", "01", "02", "03"),
    "Day 2": ("04", "05", "07", "10", "13"),
    "Day 3 (optional)": ("06", "08", "09", "11", "12"),
}


def track_of(number: str) -> str:
    """The track of notebook ``number`` ("00".."13"); KeyError names a notebook without one."""
    try:
        return TRACK[number]
    except KeyError:
        raise KeyError(f"notebook {number} has no track: add it to TRACK in {__name__}") from None


def day_of(number: str) -> str:
    """The day notebook ``number`` is taught on."""
    for day, numbers in DAYS.items():
        if number in numbers:
            return day
    raise KeyError(f"notebook {number} is on no day: add it to DAYS in {__name__}")


def check_plan() -> None:
    """Every notebook on exactly one day; the core track on the first two days, the deep dives after.
    Raises ValueError naming what disagrees."""
    taught = [n for numbers in DAYS.values() for n in numbers]
    if sorted(taught) != sorted(TRACK):
        raise ValueError(f"DAYS and TRACK disagree on notebooks {sorted(set(taught) ^ set(TRACK))}")
    if len(taught) != len(set(taught)):
        raise ValueError(f"a notebook is on two days: {sorted(n for n in taught if taught.count(n) > 1)}")
    days = list(DAYS.values())
    wrong = [n for numbers in days[:2] for n in numbers if TRACK[n] != CORE]
    wrong += [n for numbers in days[2:] for n in numbers if TRACK[n] != DEEP_DIVE]
    if wrong:
        raise ValueError(f"notebooks {wrong} are on a day of the other track")
