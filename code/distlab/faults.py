"""Faults put into a running Slurm job on purpose, and the checkpoint interval that pays (notebook 10).

A rank of a running job is found and signalled from inside the job's allocation, as on any
cluster: a step that overlaps the job (``srun --jobid=J --overlap``) runs on its nodes, asks the
node's ``slurmstepd`` for the job's processes (``scontrol listpids J``) and picks the training
process of the wanted rank (``RANK`` in its environment, as torchrun sets it, else Slurm's
``SLURM_PROCID``)::

    srun --jobid=J --overlap -N2 --ntasks-per-node=1 python -m distlab.faults pids
    srun --jobid=J --overlap -N2 --ntasks-per-node=1 python -m distlab.faults signal --rank 3 \\
        --signal KILL --after-iteration 80 --log jobs/x.out

``signal`` waits until the job's log shows iteration 80 (the log is on the shared file system),
then sends the signal; the node that does not hold the rank prints nothing. ``kill-node`` (same
options but ``--rank``) signals every process of the job on the node it runs on (but its own
step's): a node lost. From Python:
:func:`rank_pids`, :func:`inject` and :func:`kill_node`.

How often to checkpoint (Young 1974, Daly 2006), for a save that takes C seconds and a mean time
between failures M: a failure loses on average half an interval plus the restart R, a save costs C
every interval tau, so the expected fraction of time lost is about

    C / tau + (tau / 2 + R) / M,   smallest at   tau = sqrt(2 C M)   (Young; Daly adds - C for C << M)
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from distlab.jobs import refresh
from distlab.slurm_job import FINAL_STATES, Job

#: The last iteration line of a log (``distlab.logs.formats.ITERATION``'s start).
_ITERATION = re.compile(r"^ iteration\s+(\d+)/", re.M)
SCRIPT = "pretrain_gpt.py"


def young_daly_interval(save_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval sqrt(2 C M), in seconds (the time between saves)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's first-order refinement, sqrt(2 C M) - C (for C < M / 2; else M)."""
    return young_daly_interval(save_s, mtbf_s) - save_s if save_s < mtbf_s / 2 else mtbf_s


def lost_fraction(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected fraction of time lost to saves and failures: C / tau + (tau / 2 + R) / M."""
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def job_mtbf_s(per_device_mtbf_s: float, devices: int) -> float:
    """Independent failures: a job of N devices fails N times as often as one device."""
    return per_device_mtbf_s / devices


# --- on a node of the job (python -m distlab.faults ..., through srun --overlap) ---


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
    parser = argparse.ArgumentParser(prog="python -m distlab.faults", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pids", help="print 'node rank pid' for this node's training processes of the job")
    sig = sub.add_parser("signal", help="signal one rank of the job (on the node that runs it)")
    sig.add_argument("--rank", type=int, required=True)
    node = sub.add_parser("kill-node", help="signal all of the job's processes on this node (a node lost)")
    for p in (sig, node):
        p.add_argument("--signal", default="KILL", help="KILL, STOP, CONT, TERM, USR1, ...")
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
    return _kill_node(args) if args.command == "kill-node" else _signal_rank(args)


# --- from the notebook (the login node) ---


def _step_env() -> dict[str, str]:
    """This environment without the site's GPU request for steps (``SLURM_GPUS_PER_NODE``): a step
    into a job that asked for no GPUs must ask for none, and one that did gets the job's anyway."""
    return {k: v for k, v in os.environ.items() if k != "SLURM_GPUS_PER_NODE"}


def _overlap(job: Job, *command: str) -> list[str]:
    """srun one task per node of ``job``, inside its allocation."""
    nodes = int(refresh(job).info.get("NumNodes", "1").split("-")[0])
    return ["srun", f"--jobid={job.id}", "--overlap", f"-N{nodes}", f"-n{nodes}", "--ntasks-per-node=1",
            "--cpus-per-task=1", *command]  # fmt: skip


def rank_pids(job: Job, expected: int | None = None, timeout: float = 60) -> dict[int, tuple[str, int]]:
    """rank -> (node, pid) of the job's training processes, asked on every node of the job; with
    ``expected``, asked again until that many ranks are found (a loaded node may list a worker
    before its environment is readable), else a RuntimeError naming the ranks found."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(
            _overlap(job, sys.executable, "-m", "distlab.faults", "pids", "--job", str(job.id)),
            capture_output=True, text=True, timeout=timeout, env=_step_env(),
        )  # fmt: skip
        if out.returncode:
            raise RuntimeError(f"srun --overlap into job {job.id} failed: {out.stderr.strip()}")
        found = {}
        for line in out.stdout.splitlines():
            node, rank, pid = line.split()
            found[int(rank)] = (node, int(pid))
        if expected is None or len(found) >= expected:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"job {job.id}: found ranks {sorted(found)} of {expected} after {timeout:.0f} s"
            )
        time.sleep(0.5)


def kill_node(job: Job, node: str | None = None, sig: str = "KILL", after_iteration: int = 0) -> str:
    """Once the log shows ``after_iteration`` (at once without it), signal every process of ``job``
    on ``node`` (default: the job's last node), as the node's loss would end them: its ``torchrun``
    agent and that agent's workers at once. Returns the line of what was killed. The first node runs
    the batch script (and here the rendezvous store): losing it ends the job whatever torchrun does."""
    wait_for_state(job, {"RUNNING"})
    if node is None:
        listed = subprocess.run(["scontrol", "show", "hostnames", refresh(job).nodes], capture_output=True,
                                text=True, check=True)  # fmt: skip
        node = listed.stdout.split()[-1]
    out = subprocess.run(
        ["srun", f"--jobid={job.id}", "--overlap", "-N1", "-n1", f"--nodelist={node}", "--cpus-per-task=1",
         sys.executable, "-m", "distlab.faults", "kill-node", "--job", str(job.id), "--signal", sig,
         "--after-iteration", str(after_iteration), "--log", str(job.log_path)],
        capture_output=True, text=True, timeout=600, env=_step_env(),
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"srun --overlap into job {job.id} on {node} failed: {out.stderr.strip()}")
    return out.stdout.strip()


def inject(job: Job, rank: int, sig: str = "KILL", after_iteration: int = 0) -> subprocess.Popen:
    """Start a step in ``job`` that sends ``sig`` to ``rank`` once the log shows ``after_iteration``
    (every rank runs by then; without it, at once); returns it running (``.communicate()`` gives the
    line of the node that sent it)."""
    wait_for_state(job, {"RUNNING"})
    cmd = [sys.executable, "-m", "distlab.faults", "signal", "--job", str(job.id), "--rank", str(rank),
           "--signal", sig]  # fmt: skip
    if after_iteration:
        cmd += ["--after-iteration", str(after_iteration), "--log", str(job.log_path)]
    return subprocess.Popen(
        _overlap(job, *cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_step_env()
    )


def wait_for_state(job: Job, states: set[str], timeout: float = 300, reason: str | None = None) -> Job:
    """Poll until the job is in one of ``states`` (and, when given, pends for ``reason``)."""
    deadline = time.monotonic() + timeout
    while True:
        state = refresh(job).state.split()[0]
        if state in states and (reason is None or job.reason == reason):
            return job
        if state in FINAL_STATES - states:
            raise RuntimeError(f"job {job.id} ended {state} while waiting for {sorted(states)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job.id} still {state} ({job.reason}) after {timeout:.0f} s")
        time.sleep(0.2)


def wait_for_iteration(job: Job, iteration: int, timeout: float = 300) -> int:
    """Poll the job's log until it shows ``iteration``; return the last iteration seen."""
    deadline = time.monotonic() + timeout
    while True:
        seen = last_iteration(job.log())
        if seen >= iteration:
            return seen
        if refresh(job).state.split()[0] in FINAL_STATES or time.monotonic() > deadline:
            raise RuntimeError(f"job {job.id} is {job.state} and its log stops at iteration {seen}")
        time.sleep(0.05)


def wait_for_attempt(job: Job, number: int, timeout: float = 300) -> float:
    """Poll until the ``number``-th training attempt in the job's log has logged an iteration; return
    the seconds waited. Called right after a kill, that is the **restart cost** R: the failure
    noticed, the agents' new rendezvous, fresh processes (imports, process groups, the checkpoint
    loaded) and one iteration."""
    from distlab.logs.restarts import attempts  # here: the nodes' side of this module stays torch-free

    start = time.monotonic()
    deadline = start + timeout
    while True:
        runs = attempts(job.log())
        if len(runs) >= number and runs[number - 1].losses:
            return time.monotonic() - start
        if refresh(job).state.split()[0] in FINAL_STATES or time.monotonic() > deadline:
            raise RuntimeError(
                f"job {job.id} is {job.state} and its log shows {len(runs)} attempt(s), not {number}"
            )
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
