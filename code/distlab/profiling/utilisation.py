"""Utilisation over time, sampled on every node beside a batch job: one CSV per node.

Every ``interval`` seconds one row: ``time`` (Unix seconds), ``node``, ``cpu`` (mean %, all cores),
``cpu0 .. cpuN`` (% per core), ``job_rss_mib`` (resident memory of the job's processes on this
node, those whose environment holds this ``SLURM_JOB_ID`` and ``SLURMD_NODENAME``), ``job_procs``,
then for every GPU that NVML sees ``gpu<i>_util`` (%), ``gpu<i>_mem_mib``, ``gpu<i>_power_w``.
No GPU (or no NVIDIA driver): no GPU columns.

It never outlives the job: it stops on its stop file, on SIGTERM (Slurm ends a job's steps so),
when its parent exits (it is then an orphan), or after ``max_seconds``. Rows are flushed one by
one, so a killed sampler leaves a complete CSV. The batch script (see ``code/sample_utilisation.py``)::

    srun --overlap --ntasks-per-node=1 python $LAB_CODE/sample_utilisation.py \\
        --output-dir runs/util/$SLURM_JOB_ID --stop-file runs/util/$SLURM_JOB_ID/STOP &
    srun ... torchrun ... pretrain_gpt.py ...
    touch runs/util/$SLURM_JOB_ID/STOP; wait
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil


@dataclass
class SamplerConfig:
    output_dir: str
    """Folder of the CSVs: ``<output_dir>/<node>.csv``."""
    interval: float = 1.0
    """Seconds between two rows."""
    stop_file: str | None = None
    """Stop once this file exists (the batch script touches it after training)."""
    max_seconds: float | None = None
    """Stop after this long whatever happens (a bound for runs outside Slurm)."""
    job_id: str | None = field(default_factory=lambda: os.environ.get("SLURM_JOB_ID"))
    """Whose processes count as the job's; without it, the sampler's parent's process tree."""
    node: str = field(default_factory=lambda: os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    """This node's name: the CSV's name and ``node`` column."""

    def __post_init__(self) -> None:
        if self.interval <= 0:
            raise ValueError(f"--interval must be > 0 seconds, got {self.interval}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"--max-seconds must be > 0, got {self.max_seconds}")


class GPUs:
    """NVML handles of this node's GPUs; none where NVML (the NVIDIA driver) is missing."""

    def __init__(self) -> None:
        self.nvml, self.handles = None, []
        try:
            import pynvml

            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            self.nvml, self.handles = pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        except Exception:  # no library, no driver, no device: CPU-only node
            self.handles = []

    def columns(self) -> list[str]:
        return [f"gpu{i}_{k}" for i in range(len(self.handles)) for k in ("util", "mem_mib", "power_w")]

    def read(self) -> list[float]:
        out = []
        for h in self.handles:
            util = self.nvml.nvmlDeviceGetUtilizationRates(h).gpu
            mem = self.nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
            out += [util, round(mem, 1), self.nvml.nvmlDeviceGetPowerUsage(h) / 1000.0]
        return out


class JobProcesses:
    """The job's processes on this node: same ``SLURM_JOB_ID`` and node name in their environment."""

    def __init__(self, job_id: str | None, node: str) -> None:
        self.job_id, self.node, self.me = job_id, node, os.getpid()
        self.known: dict[tuple[int, float], bool] = {}  # (pid, create time) -> belongs to the job

    def _belongs(self, p: psutil.Process) -> bool:
        if self.job_id is None:  # outside Slurm: the parent's tree (the shell or launcher that started us)
            return p.pid == os.getppid() or os.getppid() in {q.pid for q in p.parents()}
        env = p.environ()
        return env.get("SLURM_JOB_ID") == self.job_id and env.get("SLURMD_NODENAME", self.node) == self.node

    def rss(self) -> tuple[float, int]:
        """(resident MiB, number of processes) of the job on this node, the sampler excluded."""
        total, count, alive = 0, 0, set()
        for p in psutil.process_iter():
            try:
                key = (p.pid, p.create_time())
                alive.add(key)
                if key not in self.known:
                    self.known[key] = p.pid != self.me and self._belongs(p)
                if self.known[key]:
                    total, count = total + p.memory_info().rss, count + 1
            except (psutil.Error, OSError):
                continue
        self.known = {k: v for k, v in self.known.items() if k in alive}
        return total / 2**20, count


def sample(cfg: SamplerConfig) -> Path:
    """Write ``<output_dir>/<node>.csv`` until a stop condition; return its path."""
    path = Path(cfg.output_dir) / f"{cfg.node}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    stop = {"signal": False}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.update(signal=True))
    parent, start = os.getppid(), time.time()
    gpus, procs = GPUs(), JobProcesses(cfg.job_id, cfg.node)
    cores = psutil.cpu_count() or 1
    psutil.cpu_percent(percpu=True)  # the first call only starts the measurement
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["time", "node", "cpu", *[f"cpu{i}" for i in range(cores)], "job_rss_mib", "job_procs"]
                     + gpus.columns())  # fmt: skip
        while True:
            time.sleep(cfg.interval)
            per_core = psutil.cpu_percent(percpu=True)
            rss, n = procs.rss()
            mean = sum(per_core) / len(per_core)
            out.writerow(
                [f"{time.time():.3f}", cfg.node, round(mean, 1), *per_core, round(rss, 1), n, *gpus.read()]
            )
            f.flush()
            if _should_stop(cfg, stop["signal"], parent, start):
                break
    return path


def _should_stop(cfg: SamplerConfig, signalled: bool, parent: int, start: float) -> bool:
    """Stop file, SIGTERM, orphaned (parent gone), or past ``max_seconds``."""
    if signalled or os.getppid() != parent:
        return True
    if cfg.stop_file and os.path.exists(cfg.stop_file):
        return True
    return cfg.max_seconds is not None and time.time() - start >= cfg.max_seconds


def read_csvs(folder: str | os.PathLike) -> dict[str, dict[str, list]]:
    """``{node: {column: values}}`` of every ``<node>.csv`` in ``folder`` (numbers as floats)."""
    paths = sorted(Path(folder).glob("*.csv"))
    if not paths:
        raise FileNotFoundError(
            f"no utilisation CSV in {folder}: did the batch script start code/sample_utilisation.py "
            "with --output-dir there, and did the job run?"
        )
    nodes = {}
    for p in paths:
        with open(p, newline="") as f:
            rows = list(csv.DictReader(f))
        cols = {k: [r[k] for r in rows] for k in (rows[0] if rows else [])}
        nodes[p.stem] = {k: (v if k == "node" else [float(x) for x in v]) for k, v in cols.items()}
    return nodes
