"""Workshop mode: N learners and an instructor on one machine, one shared cluster (issue 22).

``sudo ./lab workshop --learners N`` (safe to re-run; ``./lab workshop stop``) does, in order:

1. checks that the class fits: each learner gets (memory - RESERVED_GIB) / N of RAM, at least
   MIN_GIB_PER_LEARNER (a JupyterLab, a kernel and a two-rank job), and nproc / N cores;
2. makes the accounts (``users.ensure``: account, workspace with its own notebooks, association
   to the Slurm account ``learners``) ``<prefix>01`` .. and the instructor, sets a generated
   password on each account that has none, and prints the new ones once;
3. turns on Slurm's limits (the file ``workshop`` in the cluster folder; config.slurm_conf reads
   it): ``AccountingStorageEnforce=associations,limits,qos``, fair share
   (``priority/multifactor``), ``PrivateData=jobs``; the QOS ``workshop`` of every learner caps a
   user at the plan's Limits (by default half the cluster's CPUs: a runaway job leaves the rest);
   the instructor is a Slurm operator (sees every job, cancels any) in the account ``instructors``
   and in the Linux group ``lab-instructors``, which reads the progress folder (distlab.progress);
4. starts JupyterHub (hub.py) on 127.0.0.1, each learner's JupyterLab as that learner.

``stop`` ends the hub (and with it every learner's server) and cancels every learner's job; the
accounts, workspaces and limits stay.
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from distlab import progress
from distlab.cluster import accounting, classfile, daemons, hub, users
from distlab.cluster.config import CPUS_PER_NODE, NODES, ClusterPaths, local_paths
from distlab.cluster.process import ClusterError, run

RESERVED_GIB = 2.0  # the daemons, MariaDB, the hub and its proxy
MIN_GIB_PER_LEARNER = 2.0
INSTRUCTORS_ACCOUNT = "instructors"
QOS = "workshop"
CLUSTER_CPUS = CPUS_PER_NODE * len(NODES)
WALL = re.compile(r"(\d+-)?\d{1,2}:\d{2}:\d{2}")  # Slurm's [D-]HH:MM:SS


@dataclass(frozen=True)
class Limits:
    """Per learner, the QOS ``workshop``: CPUs at once (by default half the cluster: the largest
    notebook job, 2 nodes x 32), running jobs, submitted jobs, and a job's time limit."""

    cpus: int = CLUSTER_CPUS // 2
    jobs: int = 4
    queued_jobs: int = 16
    wall: str = "01:00:00"

    def qos(self) -> tuple[str, ...]:
        """``sacctmgr modify qos`` settings."""
        return (
            f"MaxTRESPerUser=cpu={self.cpus}",
            f"MaxJobsPerUser={self.jobs}",
            f"MaxSubmitJobsPerUser={self.queued_jobs}",
            f"MaxWall={self.wall}",
        )

    def check(self) -> None:
        if not 1 <= self.cpus <= CLUSTER_CPUS:
            raise ClusterError(
                f"cpus = {self.cpus}: a learner's CPUs must be 1 .. {CLUSTER_CPUS} (the cluster's)"
            )
        if not 1 <= self.jobs <= self.queued_jobs:
            raise ClusterError(
                f"jobs = {self.jobs}, queued_jobs = {self.queued_jobs}: need 1 <= jobs <= queued_jobs "
                f"(running jobs are among the submitted ones)"
            )
        if not WALL.fullmatch(self.wall):
            raise ClusterError(f"wall = {self.wall!r}: a job's time limit is HH:MM:SS or D-HH:MM:SS")


@dataclass(frozen=True)
class Plan:
    """The class: ``learners`` accounts named ``<prefix>01``.. (or the names in ``accounts``), one
    ``instructor``, the hub's ``port`` and each learner's Slurm ``limits``."""

    learners: int
    prefix: str = "learner"
    instructor: str = "instructor"
    port: int = 8000
    accounts: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)

    @property
    def names(self) -> list[str]:
        if self.accounts:
            return list(self.accounts)
        return [f"{self.prefix}{i:02d}" for i in range(1, self.learners + 1)]

    def check(self, memory_gib: float, cores: int) -> str:
        """Refuse what cannot work, with the numbers; else one line: what each learner gets."""
        if self.learners < 1:
            raise ClusterError(f"--learners {self.learners}: a workshop needs at least one learner")
        for name in [*self.names, self.instructor]:
            if not users.NAME.fullmatch(name):
                raise ClusterError(
                    f"{name!r} is not a valid user name (lower case letters, digits, _ and -, at most 32)"
                )
        if len(set(self.names)) != len(self.names):
            twice = sorted({n for n in self.names if self.names.count(n) > 1})
            raise ClusterError(f"learner name(s) {twice} given twice: each learner needs their own account")
        if self.instructor in self.names:
            raise ClusterError(f"the instructor {self.instructor!r} is also a learner's name: choose another")
        if not 1024 <= self.port <= 65533:
            raise ClusterError(
                f"port {self.port}: the hub needs port, port + 1 and port + 2 in 1024 .. 65535"
            )
        self.limits.check()
        share = (memory_gib - RESERVED_GIB) / self.learners
        if share < MIN_GIB_PER_LEARNER:
            most = int((memory_gib - RESERVED_GIB) // MIN_GIB_PER_LEARNER)
            raise ClusterError(
                f"{self.learners} learners do not fit: this machine has {memory_gib:.1f} GiB "
                f"({RESERVED_GIB:.0f} GiB kept for the daemons and the hub), so each learner would get "
                f"{share:.1f} GiB, below the {MIN_GIB_PER_LEARNER:.0f} GiB a JupyterLab, a kernel and "
                f"a two-rank job need; at most {most} learners here"
            )
        return (
            f"{self.learners} learners: {share:.1f} GiB of RAM and {cores / self.learners:.2g} "
            f"of {cores} cores each (shared in time); in Slurm: {', '.join(self.limits.qos())} each"
        )


def plan_from_file(path: Path) -> Plan:
    """The class described in ``path`` (distlab.cluster.classfile)."""
    plan, limits = classfile.load(path)
    return Plan(**plan, limits=Limits(**limits))


def machine() -> tuple[float, int]:
    """(memory in GiB, cores) of this machine."""
    kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    return kib / 2**20, os.cpu_count() or 1


def has_password(name: str) -> bool:
    out = subprocess.run(["passwd", "-S", name], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and out.stdout.split()[1] == "P"


def set_password(name: str) -> str:
    password = secrets.token_urlsafe(9)
    out = subprocess.run(
        ["chpasswd"], input=f"{name}:{password}\n", capture_output=True, text=True, timeout=30
    )
    if out.returncode != 0:
        raise ClusterError(f"chpasswd for {name} failed: {out.stderr.strip()}")
    return password


def ensure_group() -> int:
    try:
        return grp.getgrnam(progress.INSTRUCTORS_GROUP).gr_gid
    except KeyError:
        subprocess.run(["groupadd", "--system", progress.INSTRUCTORS_GROUP], check=True, timeout=30)
        return grp.getgrnam(progress.INSTRUCTORS_GROUP).gr_gid


def progress_folder(p: ClusterPaths) -> Path:
    """The folder each learner's checks write to (distlab.progress's modes), made if missing."""
    folder = p.root / "progress"
    folder.mkdir(exist_ok=True)
    os.chown(folder, 0, ensure_group())
    folder.chmod(progress.FOLDER_MODE)
    return folder


def enable_limits(p: ClusterPaths) -> bool:
    """Mark the cluster a workshop's (slurm.conf then enforces limits); True if it was not yet."""
    marker = p.root / "workshop"
    if marker.exists():
        return False
    p.root.mkdir(parents=True, exist_ok=True)
    marker.write_text("Slurm's limits are enforced: see distlab.cluster.workshop\n")
    return True


def apply_limits(p: ClusterPaths, limits: Limits) -> None:
    """The QOS ``workshop`` on the account ``learners``; the instructors' account without it."""
    if not run(["sacctmgr", "-n", "-P", "show", "qos", QOS, "format=name"], p).split():
        run(["sacctmgr", "-i", "add", "qos", QOS], p)
    run(["sacctmgr", "-i", "modify", "qos", QOS, "set", *limits.qos()], p)
    account = [
        "where",
        f"account={accounting.LEARNERS_ACCOUNT}",
        "set",
        f"QOS=normal,{QOS}",
        f"DefaultQOS={QOS}",
    ]
    run(["sacctmgr", "-i", "modify", "account", *account], p)


def ensure_instructor(p: ClusterPaths, name: str, checkout: Path = users.CHECKOUT) -> users.Learner:
    """The instructor's account, workspace (with ``instructor/progress.ipynb``), group and powers."""
    person = users.ensure(name, None, checkout)
    copy = 'mkdir -p "$1" && cp -n "$2"/*.ipynb "$1"/'
    view = [str(person.workspace / "instructor"), str(checkout / "instructor")]
    if (checkout / "instructor").is_dir() and person.run(["sh", "-c", copy, "sh", *view]).returncode != 0:
        raise ClusterError(f"could not copy the instructor's notebooks into {view[0]}")
    gid = ensure_group()
    if gid not in os.getgrouplist(name, person.gid):
        subprocess.run(
            ["usermod", "--append", "--groups", progress.INSTRUCTORS_GROUP, name], check=True, timeout=30
        )
    accounting.add_user(p, name, account=INSTRUCTORS_ACCOUNT)
    level = run(["sacctmgr", "-n", "-P", "show", "user", name, "format=adminlevel"], p).strip()
    if level != "Operator":
        run(["sacctmgr", "-i", "modify", "user", name, "set", "AdminLevel=Operator"], p)
    return person


def refuse_others_accounts(plan: Plan) -> None:
    """An existing account that the lab did not make (another person's) is refused, never changed."""
    for name in [*plan.names, plan.instructor]:
        if (who := users.lookup(name)) is not None and pwd.getpwnam(name).pw_gecos != users.COMMENT:
            raise ClusterError(
                f"a user {name} (uid {who.uid}) exists and was not made by the lab: not touching it; "
                f"choose other names with --prefix / --instructor"
            )


def ensure_accounts(p: ClusterPaths, plan: Plan, checkout: Path = users.CHECKOUT) -> dict[str, str | None]:
    """Every account of ``plan`` ready; {name: its new password, or None where it had one}."""
    refuse_others_accounts(plan)
    learners = [users.ensure(name, p, checkout) for name in plan.names]
    apply_limits(p, plan.limits)
    people = [*learners, ensure_instructor(p, plan.instructor, checkout)]
    return {who.name: None if has_password(who.name) else set_password(who.name) for who in people}


def start(plan: Plan, p: ClusterPaths | None = None) -> str:
    """Steps 1-4 of the module's docstring; what to tell the class (the new passwords once)."""
    p = p or local_paths()
    fits = plan.check(*machine())
    refuse_others_accounts(plan)
    hub.check_ports(plan.port)
    if enable_limits(p) and daemons.is_up(p):  # slurmctld reads the new slurm.conf on restart
        print(daemons.restart_controller(p))
    daemons.start(p)
    passwords = ensure_accounts(p, plan)
    folder = progress_folder(p)
    keep = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}  # a checkout's code first
    url = hub.start(hub.Settings(plan.port, [*plan.names], plan.instructor, p, folder, keep))
    lines = [fits, f"JupyterHub: {url} (log: {hub.log_file()})", "accounts (passwords shown once):"]
    for name, password in passwords.items():
        role = "instructor" if name == plan.instructor else "learner"
        lines.append(f"  {name:12s} {password or '(password unchanged)'}  {role}")
    lines.append(f"progress: `sudo -u {plan.instructor} ./lab progress` (folder {folder})")
    return "\n".join(lines)


def stop(p: ClusterPaths | None = None) -> str:
    """End the hub, every learner's server and every job of the learners; keep their work."""
    p = p or local_paths()
    ended = hub.stop()
    cancelled = 0
    if daemons.is_up(p):
        queued = run(["squeue", "-h", "-A", accounting.LEARNERS_ACCOUNT, "-o", "%i"], p, check=False).split()
        if queued:
            run(["scancel", *queued], p, check=False)
        cancelled = len(queued)
    return f"{ended}; {cancelled} learner job(s) cancelled; accounts and workspaces kept"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab workshop", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", nargs="?", default="start", choices=["start", "stop"])
    parser.add_argument(
        "--config", type=Path, help="the class in a TOML file (see distlab.cluster.classfile)"
    )
    parser.add_argument("--learners", type=int, help="number of learner accounts")
    parser.add_argument("--prefix", help="learners are PREFIX01, PREFIX02, ... (default learner)")
    parser.add_argument("--instructor", help="the instructor's account (default instructor)")
    parser.add_argument("--port", type=int, help="JupyterHub's port on 127.0.0.1 (default 8000)")
    args = parser.parse_args(argv)
    flags = {
        k: v for k in ("learners", "prefix", "instructor", "port") if (v := getattr(args, k)) is not None
    }
    if args.action == "start" and args.config is not None and flags:
        parser.error(f"--config {args.config} describes the class: leave out --{' --'.join(flags)}")
    if args.action == "start" and args.config is None and "learners" not in flags:
        parser.error("start needs --learners N or --config FILE")
    if os.geteuid() != 0:
        print("lab workshop: run as root (`sudo ./lab workshop ...`): it makes accounts", file=sys.stderr)
        return 1
    try:
        if args.action == "stop":
            print(stop())
        else:
            print(start(plan_from_file(args.config) if args.config else Plan(**flags)))
    except ClusterError as e:
        print(f"lab workshop {args.action}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
