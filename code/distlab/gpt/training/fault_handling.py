"""What a run does when it is told to stop (a signal) and when a rank stops answering (a hang).

**--exit-signal-handler** (Megatron-LM's ``DistributedSignalHandler``)::

    handler = ExitSignal("SIGUSR1").install()  # from now on the signal only sets a flag
    ...                                         # end of every iteration, on every rank:
    MAX all-reduce of handler.received          # (pretrain.stop_requested) one rank's signal stops all
    save, then pretrain.EXIT_SIGNAL's line; exit 0
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
recv operation to complete", without saying for whom. Every rank that got that error then dumps its
flight record (``distlab.flight_recorder``: the last collectives it entered, with group, sequence
number and sizes) beside the others', waits up to ``HANG_GRACE_S`` for the other ranks' dumps and
prints ``pretrain.HANG``: the ranks that wrote none, the collective they did not join, on which
node. No rank is special: a frozen rank 0 is named as any other (``dist.monitored_barrier``, which
rank 0 runs, cannot). On GPUs NCCL's watchdog aborts a collective past the timeout
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``) and the process with it, so no rank prints the report: the
watchdog writes the same dumps itself into the run's folder (``distlab.nccl_dumps`` sets
``TORCH_NCCL_DUMP_ON_TIMEOUT`` and ``TORCH_FR_DUMP_TEMP_FILE`` before the group exists) and
``diagnose_hang.py`` prints the same report from them after the job.
"""

from __future__ import annotations

import datetime
import signal
from types import FrameType

import torch.distributed as dist

#: The signals ``--exit-signal`` accepts (Megatron-LM's SIGNAL_MAP), caught by :class:`ExitSignal`.
SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")

#: Seconds a rank that timed out waits for the other ranks' flight-record dumps: the ranks that
#: time out do so within about one iteration of each other; the report comes within the timeout + 30 s.
HANG_GRACE_S = 10.0

#: The least a collective waits while the run starts. The ranks reach their first collectives at
#: different moments (importing torch, building the model, reading the data take longer on some
#: ranks, and many seconds longer on a loaded machine: a 12 s ``--distributed-timeout-minutes 0.2``
#: once timed out in the all-gather after building), and a slow start is not a hang. So the groups
#: start with the longer of this and the run's timeout, and :func:`set_training_timeout` gives them
#: ``--distributed-timeout-minutes`` once every rank is built (Megatron-LM applies its timeout from
#: the start; its default, 10 minutes, is longer than any start).
STARTUP_TIMEOUT_S = 300.0


def startup_timeout_s(distributed_timeout_minutes: float) -> float:
    """Seconds a collective may wait before the first iteration: max(the run's timeout, 300 s)."""
    return max(60 * distributed_timeout_minutes, STARTUP_TIMEOUT_S)


def set_training_timeout(groups: list[dist.ProcessGroup], distributed_timeout_minutes: float) -> None:
    """From now on, a collective of the default group or of ``groups`` that waits longer than
    ``--distributed-timeout-minutes`` fails (``torch.distributed.set_timeout``; gloo and NCCL)."""
    timeout = datetime.timedelta(minutes=distributed_timeout_minutes)
    for group in [None, *groups]:
        dist.set_timeout(timeout, group)


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


def is_hang(exc: BaseException, waited_s: float, timeout_s: float) -> bool:
    """This rank survived a hang: its gloo collective waited out the process group's timeout
    ("Timed out waiting"), or a peer in the same collective timed out a moment earlier and closed
    its connections ("Connection closed by peer" after at least half the timeout). A peer that
    crashed closes them long before the timeout. (NCCL's watchdog aborts the process instead.)"""
    text = str(exc) if isinstance(exc, RuntimeError) else ""
    return "Timed out waiting" in text or ("Connection closed by peer" in text and waited_s >= timeout_s / 2)


__all__ = [
    "HANG_GRACE_S",
    "SIGNALS",
    "STARTUP_TIMEOUT_S",
    "ExitSignal",
    "is_hang",
    "set_training_timeout",
    "startup_timeout_s",
]
