"""The faults' agent, run on the nodes of a job by ``srun --jobid=J --overlap`` (``distlab.faults``
starts it): it finds the job's processes on its node (``scontrol listpids J``), picks the training
process of a rank (``RANK`` in its environment, as torchrun sets it, else Slurm's ``SLURM_PROCID``)
and signals it, or every process of the job on the node (a node lost)::

    srun --jobid=J --overlap -N2 --ntasks-per-node=1 python -m distlab.fault_agent pids
    srun --jobid=J --overlap -N2 --ntasks-per-node=1 python -m distlab.fault_agent signal --rank 3 \\
        --signal KILL --after-iteration 80 --log jobs/x.out
    srun --jobid=J --overlap -N1 --nodelist=node2 python -m distlab.fault_agent kill-node --signal KILL
    srun --jobid=J --overlap -N2 --ntasks-per-node=1 python -m distlab.fault_agent throttle --rank 2 \
        --share 0.5 --after-iteration 5 --log jobs/x.out

``signal`` waits until the job's log (on the shared file system) shows iteration 80, then sends the
signal; the node that does not hold the rank prints nothing. ``throttle`` makes a straggler: it
stops the rank (SIGSTOP) for ``--share`` of every ``--period`` (200 ms) and lets it run (SIGCONT) the
rest, until the rank ends, as a busy neighbour taking that share of its processor would. It imports neither torch nor the
course's other modules: it starts between two iterations of the run it signals.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

#: The last iteration line of a log (``distlab.gpt.training.log.ITERATION``'s start).
_ITERATION = re.compile(r"^ iteration\s+(\d+)/", re.M)
SCRIPT = "pretrain_gpt.py"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)


def runs_script(cmdline: list[str], script: str = SCRIPT) -> bool:
    """Whether a command line runs ``script`` itself (``python [-u] .../pretrain_gpt.py ...``),
    not a launcher that names it (``torchrun ... pretrain_gpt.py``, ``python -m torch.distributed.run``)."""
    for arg in cmdline[1:]:  # the interpreter's options, then the program it runs
        if arg in ("-m", "-c"):
            return False
        if not arg.startswith("-"):
            return Path(arg).name == script
    return False


def job_pids(job_id: str) -> list[tuple[int, str]]:
    """This node's processes of job ``job_id``: (pid, step id), from ``scontrol listpids``."""
    out = subprocess.run(["scontrol", "listpids", job_id], capture_output=True, text=True, check=True)
    rows = [line.split() for line in out.stdout.splitlines()[1:]]  # PID JOBID STEPID LOCALID GLOBALID
    return [(int(row[0]), row[2]) for row in rows]


def node_ranks(job_id: str, script: str = SCRIPT) -> dict[int, int]:
    """This node's training processes of job ``job_id``: rank -> pid."""
    ranks = {}
    for pid, _ in job_pids(job_id):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text(errors="replace").split("\0")
            if not runs_script(cmdline, script):
                continue
            env = _environ(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended meanwhile
        rank = env.get("RANK", env.get("SLURM_PROCID"))
        if rank is not None:
            ranks[int(rank)] = pid
    return ranks


def last_iteration(text: str) -> int:
    """The last iteration a log shows (0 before the first)."""
    found = _ITERATION.findall(text)
    return int(found[-1]) if found else 0


def _wait_for_log(args: argparse.Namespace) -> bool:
    """Wait until ``--log`` shows ``--after-iteration`` (at once without it); False after ``--timeout``."""
    deadline = time.monotonic() + args.timeout
    if args.after_iteration:
        log = Path(args.log)
        while not (log.exists() and last_iteration(log.read_text(errors="replace")) >= args.after_iteration):
            if time.monotonic() > deadline:
                print(
                    f"{socket.gethostname()}: no iteration {args.after_iteration} in {log} after {args.timeout} s"
                )
                return False
            time.sleep(0.02)
    return True


def _after(args: argparse.Namespace) -> str:
    """' after iteration N was logged', read now (empty without ``--log``)."""
    return (
        f" after iteration {last_iteration(Path(args.log).read_text(errors='replace'))} was logged"
        if args.log
        else ""
    )


def _signal_rank(args: argparse.Namespace) -> int:
    """Wait for ``--after-iteration`` in ``--log``, then signal ``--rank`` if it runs here."""
    if not _wait_for_log(args):
        return 1
    pid = node_ranks(args.job, args.script).get(args.rank)
    if pid is None:
        return 0  # another node's rank
    after = _after(args)
    os.kill(pid, signal.Signals["SIG" + args.signal])
    print(f"{socket.gethostname()}: kill -{args.signal} {pid} (rank {args.rank}){after}", flush=True)
    return 0


def _throttle_rank(args: argparse.Namespace) -> int:
    """Wait for ``--after-iteration``, then stop ``--rank`` for ``--share`` of every ``--period`` s
    until it ends (if it runs here)."""
    if not _wait_for_log(args):
        return 1
    pid = node_ranks(args.job, args.script).get(args.rank)
    if pid is None:
        return 0
    print(
        f"{socket.gethostname()}: rank {args.rank} (pid {pid}) stopped {args.share:.0%} of the time{_after(args)}",
        flush=True,
    )
    stop_for_share(pid, args.share, args.period)
    return 0


def stop_for_share(pid: int, share: float, period: float) -> None:
    """Stop ``pid`` for ``share`` of the time, in cycles of about ``period`` s, until it ends.

    On a busy machine two things give a stopped process its time back. The agent's sleeps overrun
    (a sleeping process wakes late), so each stop here lasts what brings the stopped time so far to
    ``share`` of the time so far plus the coming run. And Linux's scheduler favours a process that
    has just woken over those that kept running, so short stops are partly made up when it runs:
    hence periods of 200 ms, not a few ms. Measured with 4 busy processes beside, load average
    12 to 14 on 2 cores, share 0.8: the throttled process made 0.48 to 0.88 of an unthrottled twin's
    progress with plain sleeps in 20 ms periods (its rank then did not stand out in
    ``--log-straggler``'s reports), 0.23 to 0.34 in 200 ms periods, 0.19 to 0.23 as here (0.2 expected)."""
    if not 0 < share < 1:
        raise ValueError(f"--share {share}: the fraction of the time the rank is stopped, between 0 and 1")
    run = (1 - share) * period
    start, stopped = time.monotonic(), 0.0
    try:
        while True:
            began = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            # (stopped + d) / (elapsed + d + run) = share
            time.sleep(max(0.0, (share * (began - start + run) - stopped) / (1 - share)))
            stopped += time.monotonic() - began
            os.kill(pid, signal.SIGCONT)
            time.sleep(run)
    except ProcessLookupError:
        return  # it ended


def _describe(pid: int, script: str) -> str:
    """'rank 3' for a training process, else its program ('torchrun', 'torch.distributed.run', 'python3')."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_text(errors="replace").split("\0")
    if runs_script(cmdline, script):
        env = _environ(pid)
        return f"rank {env.get('RANK', env.get('SLURM_PROCID', '?'))}"
    for i, arg in enumerate(cmdline[1:], start=1):  # the interpreter's options, then its program
        if arg in ("-m", "-c"):
            return cmdline[i + 1] if arg == "-m" else Path(cmdline[0]).name
        if arg and not arg.startswith("-"):
            return Path(arg).name
    return Path(cmdline[0]).name


def _kill_node(args: argparse.Namespace) -> int:
    """Wait for ``--after-iteration`` in ``--log``, then signal every process of the job on this node
    but this step's own: what a node's loss ends."""
    if not _wait_for_log(args):
        return 1
    after, own = _after(args), os.environ.get("SLURM_STEP_ID")
    victims = {}
    for pid, step in job_pids(args.job):
        try:
            if step != own:
                victims[pid] = _describe(pid, args.script)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # ended meanwhile
    # the agents first: a launcher that outlives its workers by a moment would start to restart them
    for pid in sorted(victims, key=lambda p: victims[p].startswith("rank")):
        try:
            os.kill(pid, signal.Signals["SIG" + args.signal])
        except ProcessLookupError:
            pass
    killed = ", ".join(f"{pid} ({what})" for pid, what in victims.items())
    print(f"{socket.gethostname()}: kill -{args.signal} {killed}{after}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m distlab.fault_agent", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pids", help="print 'node rank pid' for this node's training processes of the job")
    sig = sub.add_parser("signal", help="signal one rank of the job (on the node that runs it)")
    sig.add_argument("--rank", type=int, required=True)
    node = sub.add_parser("kill-node", help="signal all of the job's processes on this node (a node lost)")
    slow = sub.add_parser("throttle", help="stop one rank part of the time until it ends (a straggler)")
    slow.add_argument("--rank", type=int, required=True)
    slow.add_argument("--share", type=float, default=0.5, help="the fraction of each period it is stopped")
    slow.add_argument("--period", type=float, default=0.2, help="seconds (a few iterations of a tiny model)")
    for p in (sig, node):
        p.add_argument("--signal", default="KILL", help="KILL, STOP, CONT, TERM, USR1, ...")
    for p in (sig, node, slow):
        p.add_argument("--after-iteration", type=int, default=0, help="wait until the log shows it")
        p.add_argument("--log", help="the job's output file (the iteration lines)")
        p.add_argument("--timeout", type=float, default=300.0)
    for p in sub.choices.values():
        p.add_argument("--job", default=os.environ.get("SLURM_JOB_ID"), help="default: $SLURM_JOB_ID")
        p.add_argument("--script", default=SCRIPT, help="the training script's name in the command line")
    args = parser.parse_args(argv)
    if args.command == "pids":
        for rank, pid in sorted(node_ranks(args.job, args.script).items()):
            print(f"{socket.gethostname()} {rank} {pid}", flush=True)
        return 0
    return {"kill-node": _kill_node, "throttle": _throttle_rank, "signal": _signal_rank}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
