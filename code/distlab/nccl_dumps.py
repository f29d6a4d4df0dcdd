"""NCCL's own flight-recorder dumps on a timeout, armed into the run's folder before the group exists.

On NCCL a collective past the process group's timeout raises nothing the engine could catch: the
watchdog aborts it and takes the process down ("Watchdog caught collective operation timeout").
Before that it can write every live rank's flight record, the same pickle as
``torch._C._distributed_c10d._dump_nccl_trace()``, as ``<prefix><rank>``: ``diagnose_hang.py``
reads the folder after the job. torch 2.14 reads these variables when a ``ProcessGroupNCCL`` is
built (``ProcessGroupNCCL.hpp``, ``FlightRecorder.hpp``), so :func:`arm` runs before
``init_process_group``; a variable the user set is left as it is:

    TORCH_FR_BUFFER_SIZE, TORCH_NCCL_TRACE_BUFFER_SIZE   entries kept per rank (0: no recorder);
                                                         either name, the first wins
    TORCH_NCCL_DUMP_ON_TIMEOUT=1                         dump when the watchdog sees a timeout
                                                         (needs TORCH_NCCL_ENABLE_MONITORING,
                                                         on by default, and a buffer)
    TORCH_FR_DUMP_TEMP_FILE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE  the dumps' prefix (the second is
                                                         the older name); default /tmp/nccl_trace_rank_

The folder must exist: the watchdog opens ``<prefix><rank>`` and does not create directories.
"""

from __future__ import annotations

import os
from pathlib import Path

BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
PREFIX = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def user_prefix(environ: dict[str, str] | None = None) -> str | None:
    """The dumps' prefix the environment names (``TORCH_FR_DUMP_TEMP_FILE``, then the older
    ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, as torch reads them), else None."""
    env = os.environ if environ is None else environ
    return next((env[name] for name in PREFIX if env.get(name)), None)


def arm(prefix: str, entries: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set what the environment leaves unset so that a timeout writes ``<prefix><rank>``: both
    buffer names to the one the user gave, else ``entries``; ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``;
    ``TORCH_FR_DUMP_TEMP_FILE=prefix`` unless either prefix name is set. Creates the dumps'
    folder. Returns the variables it set (the caller prints nothing CUDA-specific on a CPU run:
    call this for the nccl backend only)."""
    env = os.environ if environ is None else environ
    given = next((env[name] for name in BUFFER if env.get(name)), str(entries))
    wanted = {**dict.fromkeys(BUFFER, given), DUMP_ON_TIMEOUT: "1"}
    if user_prefix(env) is None:
        wanted[PREFIX[0]] = prefix
    added = {name: value for name, value in wanted.items() if not env.get(name)}
    env.update(added)
    Path(user_prefix(env) or prefix).parent.mkdir(parents=True, exist_ok=True)
    return added


__all__ = ["BUFFER", "DUMP_ON_TIMEOUT", "PREFIX", "arm", "user_prefix"]
