"""A rank's own process: whole-line output, one-rank prints, its share of the cores, its network variables.

Contract: every rank of a job writes into the same log, so :func:`whole_line_stdout` makes each
line one write and :func:`print_on` prints a group of lines in one write from the rank chosen;
:func:`cap_cpu_threads` gives each rank its share of the usable cores; :func:`network_settings`
names the communication variables a rank received.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Mapping

import torch


def usable_cpus() -> int:
    """Cores this process may actually run on (its affinity mask), not the node's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def ranks_sharing_cores(local_world_size: int, env: Mapping[str, str] | None = None) -> int:
    """The ranks that run on this machine's cores: the node's (``local_world_size``), times the
    job's nodes where the site says that its nodes are one machine (``LAB_NODES_SHARE_CORES=1``:
    the local cluster's two nodes on loopback addresses)."""
    env = os.environ if env is None else env
    nodes = int(env.get("SLURM_JOB_NUM_NODES", "1") or 1) if env.get("LAB_NODES_SHARE_CORES") == "1" else 1
    return max(local_world_size, 1) * max(nodes, 1)


def cap_cpu_threads(local_world_size: int) -> str:
    """Cap intra-op threads to this rank's share of the usable cores; return what was done.

    Cluster scripts often export ``OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK``, which on the local
    cluster is far above the real cores and makes every rank fight for them. The share counts the
    ranks of every node that runs on these cores (:func:`ranks_sharing_cores`): one rank on each of
    the local cluster's two nodes gets half the machine each, not all of it twice.
    """
    share = max(1, usable_cpus() // ranks_sharing_cores(local_world_size))
    asked = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    threads = min(asked, share) if asked else share
    torch.set_num_threads(threads)
    note = f" (OMP_NUM_THREADS={asked} capped)" if asked > threads else ""
    return f"intra-op threads: {threads} of {usable_cpus()} usable cores{note}"


def network_settings(env: Mapping[str, str] | None = None) -> str | None:
    """This rank's communication variables (``NCCL_*``, ``GLOO_*``), or None when none is set.

    The settings a cluster's job script or DeepSpeed's ``.deepspeed_env`` gives every node (which
    interface, InfiniBand or not). Printed by every rank, they show which node received them.
    """
    env = os.environ if env is None else env
    given = sorted(f"{k}={v}" for k, v in env.items() if k.startswith(("NCCL_", "GLOO_")))
    return " ".join(given) or None


def whole_line_stdout() -> None:
    """Make every ``print`` reach stdout as one write of a whole line.

    All ranks of a job write into the same log. Unbuffered stdout (``PYTHONUNBUFFERED=1``, which
    job scripts set so that logs show progress live) writes a line's text and its newline
    separately, and another rank's line can land between the two, breaking both for ``grep``.
    Line buffering without write-through writes ``text + newline`` at once.
    """
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True, write_through=False)


def print_on(on: bool, *lines: str) -> None:
    """Print ``lines`` in one write when ``on`` is true, e.g. ``print_on(ctx.rank == 0, ...)``.

    The one print-on-one-rank helper: start-up lines from rank 0, a loss from the rank that
    holds it. One write, flushed, so another rank's line never lands inside these.
    """
    if on and lines:
        sys.stdout.write("".join(f"{line}\n" for line in lines))
        sys.stdout.flush()
