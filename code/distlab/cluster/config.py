"""Layout and configuration files of the local cluster.

Everything lives under one gitignored folder, ``.lab/cluster/`` at the repository root::

    slurm.conf  gres.conf  cgroup.conf  slurmdbd.conf   configuration (written on every start)
    munge/      key, socket, pid of the private munged
    mysql/      the accounting database (MariaDB data, socket, pid; see accounting.py)
    ctld/       slurmctld state        spool/nodeN/  slurmd spools
    log/        daemon logs            dev/gpu0,1    the GPU "devices" (see below)

The daemons run as root, as an administrator starts them; any local user may submit jobs, which
run as that user. So the folder is open to all (0755), the Slurm configuration files are readable
(0644) and the munge socket is usable by all (0777, in ``munge/``, mode 0711: it can be passed
through but not listed). What would let a user forge credentials or read others' work stays root's:
the munge key (0600), ``slurmdbd.conf`` with the database password (0600), ``mysql/`` (0700), the
controller's copies of every job's script and environment in ``ctld/`` (0700), and the daemons'
logs (0600, written so by Slurm). ``daemons._prepare_files`` sets these modes on every start.

Each node advertises the shape of a GPU cluster's node (64 CPUs, ``Gres=gpu:2``) so that sbatch
scripts written for real clusters run unchanged; ``SlurmdParameters=config_overrides`` lets these
counts stand on a 2-core machine. A ``gpu`` GRES needs device files, so ``dev/gpu0`` and
``dev/gpu1`` are character devices with the numbers of ``/dev/null``: Slurm can count and bind
them, and nothing can be computed on them. Jobs run on the CPU with gloo.
"""

from __future__ import annotations

import os
import pwd
import zlib
from dataclasses import dataclass
from pathlib import Path

from distlab import REPO_ROOT

#: (name, loopback address) of the nodes.
NODES = (("node1", "127.0.0.11"), ("node2", "127.0.0.12"))
CPUS_PER_NODE = 64
GPUS_PER_NODE = 2
PARTITION = "lab"


@dataclass(frozen=True)
class ClusterPaths:
    """Where the local cluster keeps its files, and the ports it listens on."""

    root: Path
    port_base: int = 16817  # slurmctld; slurmd of node i: port_base + 1 + i; then slurmdbd, MariaDB

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def gres_conf(self) -> Path:
        return self.root / "gres.conf"

    @property
    def cgroup_conf(self) -> Path:
        return self.root / "cgroup.conf"

    @property
    def munge_dir(self) -> Path:
        return self.root / "munge"

    @property
    def munge_key(self) -> Path:
        return self.munge_dir / "munge.key"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    @property
    def munge_pid(self) -> Path:
        return self.munge_dir / "munged.pid"

    @property
    def log_dir(self) -> Path:
        return self.root / "log"

    @property
    def ctld_pid(self) -> Path:
        return self.root / "slurmctld.pid"

    def slurmd_pid(self, node: str) -> Path:
        return self.root / f"slurmd-{node}.pid"

    @property
    def ctld_port(self) -> int:
        return self.port_base

    def slurmd_port(self, index: int) -> int:
        return self.port_base + 1 + index

    @property
    def dbd_port(self) -> int:
        return self.port_base + 1 + len(NODES)

    @property
    def db_port(self) -> int:
        return self.dbd_port + 1

    def ports(self) -> list[int]:
        return (
            [self.ctld_port]
            + [self.slurmd_port(i) for i in range(len(NODES))]
            + [self.dbd_port, self.db_port]
        )


DEFAULT_PORT_BASE = ClusterPaths.port_base
PORT_FILE = "port_base"  # in the cluster folder: the ports its configuration was written with


def local_paths() -> ClusterPaths:
    """The cluster of this checkout (``LAB_CLUSTER_DIR`` and ``LAB_CLUSTER_PORT`` override).

    The port base: ``LAB_CLUSTER_PORT``, else the one the folder's cluster was started with (its
    file ``port_base``), else the default for this checkout's own folder and, for any other folder
    (a private cluster), one derived from its path in 20000..29995: never the default cluster's."""
    default = (REPO_ROOT / ".lab" / "cluster").resolve()
    root = Path(os.environ.get("LAB_CLUSTER_DIR", default)).resolve()
    if os.environ.get("LAB_CLUSTER_PORT"):
        return ClusterPaths(root=root, port_base=int(os.environ["LAB_CLUSTER_PORT"]))
    try:
        return ClusterPaths(root=root, port_base=int((root / PORT_FILE).read_text()))
    except (OSError, ValueError):
        pass
    base = DEFAULT_PORT_BASE if root == default else 20000 + zlib.crc32(str(root).encode()) % 2000 * 5
    return ClusterPaths(root=root, port_base=base)


def slurm_conf(p: ClusterPaths, cgroups: bool) -> str:
    """slurm.conf of the two-node cluster; every daemon runs as root, each job as its submitter.

    ``cgroups``: whether memory limits are enforced by cgroups (see ``memory_limits``)."""
    user = pwd.getpwuid(os.geteuid()).pw_name  # root; not $USER, which `sudo -E` keeps as the caller
    nodes = "\n".join(
        f"NodeName={name} NodeAddr={addr} NodeHostname={name} Port={p.slurmd_port(i)} "
        f"CPUs={CPUS_PER_NODE} Boards=1 SocketsPerBoard=2 CoresPerSocket={CPUS_PER_NODE // 2} "
        f"ThreadsPerCore=1 RealMemory={node_memory_mb()} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
        for i, (name, addr) in enumerate(NODES)
    )
    first, last = NODES[0][0], NODES[-1][0]
    node_range = f"{first.rstrip('0123456789')}[{first[-1]}-{last[-1]}]"
    return f"""# Written by distlab.cluster on every start: edits here are overwritten.
ClusterName=lab
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={p.ctld_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={p.munge_socket}
StateSaveLocation={p.root}/ctld
SlurmdSpoolDir={p.root}/spool/%n
SlurmctldPidFile={p.ctld_pid}
SlurmdPidFile={p.root}/slurmd-%n.pid
SlurmctldLogFile={p.log_dir}/slurmctld.log
SlurmdLogFile={p.log_dir}/slurmd-%n.log
SlurmdParameters=config_overrides
{memory_limits(cgroups)}
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerNode={default_memory_mb()}
GresTypes=gpu
SchedulerType=sched/backfill
EnforcePartLimits=ALL
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={p.dbd_port}
AccountingStoragePass={p.munge_socket}
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=3600
{workshop_settings(p)}
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=30
{nodes}
PartitionName={PARTITION} Nodes={node_range} Default=YES MaxTime=INFINITE State=UP
"""


def workshop_settings(p: ClusterPaths) -> str:
    """In workshop mode (the file ``workshop`` in the cluster folder, see workshop.py): every job
    needs an association, whose QOS limits hold; fair share orders the queue; users see only their
    own jobs (operators and root: every job)."""
    if not (p.root / "workshop").exists():
        return "# not a workshop: any local user may submit, no limits (see workshop.py)"
    return (
        "AccountingStorageEnforce=associations,limits,qos\nPriorityType=priority/multifactor\n"
        "PriorityWeightFairshare=10000\nPriorityWeightAge=1000\nPrivateData=jobs"
    )


def node_memory_mb() -> int:
    """RealMemory of each node: this machine's memory (the nodes share it), so ``--mem`` means real RAM."""
    kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    return kib // 1024


def default_memory_mb() -> int:
    """Memory of a job that asks for none: half a node, at most 8 GiB (a two-rank GPT job on a
    node peaks near 2 GiB), so that two such jobs share a node and ``--mem`` packs more."""
    return min(node_memory_mb() // 2, 8192)


def memory_limits(cgroups: bool) -> str:
    """Plugins that enforce ``--mem``: the kernel's OOM killer in a memory cgroup per job step, or
    (without a writable cgroup v1 memory controller) Slurm's own sampling, which kills a step whose
    RSS exceeds its limit (JobAcctGatherParams=OverMemoryKill)."""
    if cgroups:
        return "ProctrackType=proctrack/cgroup\nTaskPlugin=task/cgroup"
    return "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherParams=OverMemoryKill"


def cgroup_conf() -> str:
    """cgroup.conf: confine each job step's RAM to its ``--mem`` (swap included: none allowed).

    Each slurmd keeps its jobs under ``slurm_<node>`` (Slurm's layout when several slurmd share a
    host), in this cluster's own cgroup folder (see cgroups.py)."""
    return (
        "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nConstrainRAMSpace=yes\n"
        "ConstrainSwapSpace=yes\nAllowedSwapSpace=0\n"
    )


def gres_conf(p: ClusterPaths) -> str:
    dev = p.root / "dev"
    return f"AutoDetect=off\nName=gpu File={dev}/gpu[0-{GPUS_PER_NODE - 1}]\n"
