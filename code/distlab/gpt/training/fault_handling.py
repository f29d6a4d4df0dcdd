"""What a run does when it is told to stop (a signal) and when a rank stops answering (a hang).

**--exit-signal-handler** (Megatron-LM's ``DistributedSignalHandler``)::

    handler = ExitSignal("SIGUSR1").install()  # from now on the signal only sets a flag
    ...                                         # end of every iteration, on every rank:
    MAX all-reduce of handler.received          # (pretrain.stop_requested) one rank's signal stops all
    save, then logs.formats.EXIT_SIGNAL's line; exit 0
    handler.release()                           # the previous handler is back

Why a flag and an agreement instead of exiting in the handler: the signal reaches the ranks at
different moments (Slurm's ``scancel --signal``, a node's own shutdown) or only some of them. A
rank that left on its own would leave the others waiting in the next collective until the
process-group timeout, and a checkpoint needs every rank at the same iteration. The all-reduce at
the end of each iteration costs one scalar.

Where the signal comes from on Slurm: at the time limit Slurm sends SIGTERM to every process of
the job, then SIGKILL ``KillWait`` seconds later (hence Megatron's default, SIGTERM);
``#SBATCH --signal=USR1@120`` sends SIGUSR1 to the job's steps 120 s before the limit (``B:USR1``:
to the batch shell only, which passes it on, see notebook 10). ``torchrun`` forwards the signals
named in ``--signals-to-handle`` to its workers (default SIGTERM, SIGINT, SIGHUP, SIGQUIT: add
SIGUSR1 for ``--exit-signal SIGUSR1``), then waits ``--shutdown-timeout`` seconds for them to end.

**A hang** (a rank stopped, deadlocked or on a dead node): every other rank waits in its next
collective until ``--distributed-timeout-minutes``, then gloo raises "Timed out waiting 6000ms for
recv operation to complete", without saying for whom. :func:`missing_ranks` then asks
``dist.monitored_barrier`` (gloo only: rank 0 waits for every rank, one by one, for the same time)
which ranks do not answer, and rank 0 prints ``logs.formats.HANG``. On GPUs NCCL's watchdog thread does this
job: it aborts a collective past the timeout (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) and its flight
recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``) says which ranks never
joined which collective.
"""

from __future__ import annotations

import datetime
import re
import signal
from types import FrameType

import torch.distributed as dist

from distlab.gpt.arguments.groups import SIGNALS


class ExitSignal:
    """Note the arrival of one signal (``received``) instead of its default action (most end
    the process)."""

    def __init__(self, name: str = "SIGTERM") -> None:
        if name not in SIGNALS:
            raise ValueError(f"--exit-signal {name}: choose one of {', '.join(SIGNALS)}")
        self.name = name
        self.signum = signal.Signals[name]
        self.received = False
        self._previous = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def install(self) -> ExitSignal:
        """Catch the signal from now on (main thread only, as Python's ``signal.signal``)."""
        self._previous = signal.signal(self.signum, self._handler)
        return self

    def release(self) -> None:
        """Give the signal back to the handler it had before :meth:`install`."""
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None


def is_timeout(exc: BaseException) -> bool:
    """A gloo collective that waited out the process group's timeout (NCCL's watchdog aborts instead)."""
    return isinstance(exc, RuntimeError) and "Timed out waiting" in str(exc)


def missing_ranks(timeout_s: float) -> list[int] | None:
    """After a timeout: the ranks that do not reach ``dist.monitored_barrier`` within ``timeout_s``
    (collective; gloo only). Rank 0 gets the list ([] when everyone answered); the others, and
    every rank of another backend, get None."""
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return None
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as exc:  # rank 0: "Ranks 1, 3 failed to pass monitoredBarrier in 6000 ms"
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(exc))
        return [int(r) for r in found.group(1).split(",")] if found and dist.get_rank() == 0 else None
    return [] if dist.get_rank() == 0 else None


__all__ = ["SIGNALS", "ExitSignal", "is_timeout", "missing_ranks"]
