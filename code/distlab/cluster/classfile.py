"""A class described in a file: ``sudo ./lab workshop --config class.toml``, instead of flags.

::

    [class]
    learners = ["ada", "grace", "alan"]  # their account names; or a number N: <prefix>01 .. <prefix>N
    prefix = "learner"                   # with a number only
    instructor = "instructor"
    port = 8000                          # JupyterHub on 127.0.0.1: port, port + 1, port + 2

    [limits]                             # per learner: Slurm's QOS `workshop` (workshop.Limits)
    cpus = 64                            # CPUs at once
    jobs = 4                             # running jobs
    queued_jobs = 16                     # submitted jobs, running ones included
    wall = "01:00:00"                    # a job's time limit, [D-]HH:MM:SS

Only ``learners`` is required; the rest defaults as shown. An unknown section or key, a value of the
wrong type or out of range is refused with the file, the key, the value and what is allowed, before
anything is made (``workshop.Plan.check`` checks the names, the port and the limits).
"""

from __future__ import annotations

from pathlib import Path

from distlab.cluster.process import ClusterError

#: section -> key -> (allowed types, what to write)
KEYS: dict[str, dict[str, tuple[tuple[type, ...], str]]] = {
    "class": {
        "learners": ((int, list), "a number of learners or a list of user names"),
        "prefix": ((str,), "a string"),
        "instructor": ((str,), "a user name"),
        "port": ((int,), "a port number"),
    },
    "limits": {
        "cpus": ((int,), "a number of CPUs"),
        "jobs": ((int,), "a number of jobs"),
        "queued_jobs": ((int,), "a number of jobs"),
        "wall": ((str,), 'a time limit such as "01:00:00"'),
    },
}


def _checked(path: Path, data: dict) -> dict[str, dict]:
    """``data`` with every section and key known and of its type, else a ClusterError."""
    for section, values in data.items():
        if section not in KEYS or not isinstance(values, dict):
            raise ClusterError(f"{path}: unknown section {section!r}: the sections are [class] and [limits]")
        for key, value in values.items():
            if key not in KEYS[section]:
                raise ClusterError(
                    f"{path}: unknown key {key!r} in [{section}]: the keys are {', '.join(KEYS[section])}"
                )
            types, what = KEYS[section][key]
            if isinstance(value, bool) or not isinstance(value, types):
                raise ClusterError(f"{path}: [{section}] {key} = {value!r}: should be {what}")
    learners = data.get("class", {}).get("learners")
    if learners is None:
        raise ClusterError(f"{path}: [class] learners is missing: a number, or a list of user names")
    if isinstance(learners, list) and not (learners and all(isinstance(n, str) for n in learners)):
        raise ClusterError(
            f"{path}: [class] learners = {learners!r}: should be a non-empty list of user names"
        )
    if isinstance(learners, list) and "prefix" in data["class"]:
        raise ClusterError(
            f"{path}: [class] prefix names numbered learners: with a list of names, leave it out"
        )
    return {section: data.get(section, {}) for section in KEYS}


def load(path: Path) -> tuple[dict, dict]:
    """(``workshop.Plan``'s arguments, ``workshop.Limits``' arguments) from ``path``, checked in
    form; ``Plan.check`` checks them against this machine."""
    try:
        import tomllib  # Python 3.11 on (Debian 12's python3)
    except ModuleNotFoundError as e:
        raise ClusterError("--config needs Python 3.11 or later (tomllib): give the class as flags") from e
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ClusterError(f"cannot read the class file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ClusterError(f"{path} is not valid TOML: {e}") from e
    values = _checked(path, data)
    plan = dict(values["class"])
    learners = plan.pop("learners")
    if isinstance(learners, list):
        plan.update(learners=len(learners), accounts=tuple(learners))
    else:
        plan["learners"] = learners
    return plan, values["limits"]
