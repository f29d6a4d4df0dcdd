"""Which rank a hung job waits for, and in which collective, from its flight records.

    python code/diagnose_hang.py JOBID            # the dumps of Slurm job JOBID (its WorkDir's
                                                  # flight_recorder_JOBID/, where the engine writes them)
    python code/diagnose_hang.py FOLDER           # a folder of dumps (rank_0, rank_1, ...,
                                                  # started_<rank>.json), the engine's or NCCL's
    python code/diagnose_hang.py JOBID --stacks   # and every rank's Python stack, while it runs

The same report on both backends: on gloo the engine writes the dumps when it catches the
timeout; on NCCL the watchdog writes them (``distlab.nccl_dumps`` arms it) and ends the job, and
this script reads them afterwards. The job's ranks come from the process groups' records in the
dumps (``pg_config``), so a rank without a dump is named, not assumed away: it prints
``no dump from ranks {3}: ...``, the collective each such rank did not join (operation, process
group, sequence number, sizes) and the node, pid and GPU it ran on (its start record; ``?``
without one), then every rank's last finished collective and the one it waits in
(``distlab.flight_recorder``). The dumps' prefix is inferred as PyTorch's analyzer does
(``--prefix`` to name it). ``--stacks`` runs ``py-spy dump --pid`` on every rank's process,
on its own node, through a step that overlaps the job (``srun --jobid JOBID --overlap``): a
stopped or deadlocked rank shows the line it is stuck on, the waiting ranks their collective.
PyTorch's own analyzer reads the same folder: ``torchfrtrace FOLDER`` (``--allow-incomplete-ranks``
when a rank wrote none).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from distlab import flight_recorder


def job_folder(job_id: str) -> Path:
    """The job's dump folder: ``<WorkDir>/flight_recorder_<JOBID>`` (scontrol, then sacct)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    found = re.search(r"\bWorkDir=(\S+)", shown.stdout)
    if found is None:
        acct = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "WorkDir"], capture_output=True, text=True
        )
        work_dir = acct.stdout.strip()
    else:
        work_dir = found.group(1)
    if not work_dir:
        raise SystemExit(f"diagnose_hang: Slurm does not know job {job_id} (scontrol show job, sacct)")
    return Path(work_dir) / f"flight_recorder_{job_id}"


def job_nodes(job_id: str) -> list[str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    found = re.search(r"\bNodeList=(\S+)", shown.stdout)
    if found is None or found.group(1) == "(null)":
        raise SystemExit(f"diagnose_hang: job {job_id} runs on no node (scontrol show job {job_id})")
    names = subprocess.run(["scontrol", "show", "hostnames", found.group(1)], capture_output=True, text=True)
    return names.stdout.split()


def stacks_command(job_id: str, node: str) -> list[str]:
    """One step overlapping the job on ``node``: its ranks there (``distlab.fault_agent pids``: node,
    rank, pid) and each one's Python stack (``py-spy dump --nonblocking``: it reads the memory
    without pausing the process, which a SIGSTOPped process would refuse)."""
    python = shlex.quote(sys.executable)
    py_spy = shlex.quote(str(Path(sys.executable).with_name("py-spy")))
    loop = (
        f"{python} -m distlab.fault_agent pids --job {job_id} | while read host rank pid; do "
        f'echo "--- rank $rank on $host, pid $pid"; {py_spy} dump --nonblocking --pid $pid; done'
    )
    return ["srun", f"--jobid={job_id}", "--overlap", "-N1", "-n1", f"--nodelist={node}", "bash", "-c", loop]


def print_stacks(job_id: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_GPUS_PER_NODE"}  # a step asks for no GPU
    for node in job_nodes(job_id):
        out = subprocess.run(
            stacks_command(job_id, node), capture_output=True, text=True, timeout=120, env=env
        )
        print(out.stdout + out.stderr, end="")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="a Slurm job id, or a folder of flight-recorder dumps")
    parser.add_argument("--stacks", action="store_true", help="py-spy dump of every rank (a running job)")
    parser.add_argument("--prefix", help="the dumps' file-name prefix (default: inferred, else rank_)")
    args = parser.parse_args(argv)
    folder = Path(args.job) if Path(args.job).is_dir() else job_folder(args.job)
    name = args.prefix or (flight_recorder.find_prefix(folder) if folder.is_dir() else "rank_")
    prefix = str(folder / name)
    dumps, hosts = flight_recorder.read_dumps(prefix), flight_recorder.read_hosts(prefix)
    if args.stacks:  # while the job hangs: before the timeout, there are no dumps yet
        if Path(args.job).is_dir():
            raise SystemExit("diagnose_hang: --stacks needs the job id of a running job")
        print_stacks(args.job)
    if not dumps:
        print(f"no flight records ({name}<N>) in {folder} yet: they are written when a collective times out")
        return 0
    world = flight_recorder.world_size(dumps, hosts)
    missing, lines = flight_recorder.hang_report(dumps, world, hosts)
    if missing:
        ranks = "{" + ", ".join(map(str, missing)) + "}"
        print(f"no dump from ranks {ranks}: frozen, dead or killed before the others' timeout ({folder})")
    print(f"{len(dumps)} of {world} ranks wrote a flight record in {folder}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
