"""What a node is made of: GPUs and how they connect, or CPUs, NUMA nodes and caches.

``collect()`` gathers one node's facts into a JSON-able dict; ``code/topology_report.py`` runs it
on every node of an allocation; the notebook compares the nodes side by side.

The GPU link matrix comes from ``nvidia-smi topo -m``. Its legend, from fastest to slowest path:

=======  ==================================================================================
NV#      NVLink: a bonded set of # NVLinks, GPU to GPU without PCIe
PIX      at most one PCIe bridge between the two devices
PXB      several PCIe bridges, but no PCIe host bridge
PHB      through a PCIe host bridge (the CPU's root complex)
NODE     through PCIe host bridges within one NUMA node
SYS      across NUMA nodes: PCIe plus the CPU-to-CPU link (UPI / Infinity Fabric)
X        the device itself
=======  ==================================================================================
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

LEGEND = {
    "X": "the device itself",
    "NV#": "NVLink, # bonded links (fastest GPU-to-GPU path)",
    "PIX": "at most one PCIe bridge",
    "PXB": "several PCIe bridges, no host bridge",
    "PHB": "through a PCIe host bridge (CPU root complex)",
    "NODE": "PCIe host bridges within one NUMA node",
    "SYS": "across NUMA nodes (PCIe + CPU interconnect, slowest)",
}
#: ``nvidia-smi topo -m`` of a typical 4-GPU node: NVLink pairs (0,1) and (2,3), one per CPU
#: socket, and a NIC behind the first pair's PCIe switch. Used where no GPU is at hand.
EXAMPLE_TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV4\tSYS\tSYS\tPXB\t0-31\t0\t\tN/A
GPU1\tNV4\t X \tSYS\tSYS\tPXB\t0-31\t0\t\tN/A
GPU2\tSYS\tSYS\t X \tNV4\tSYS\t32-63\t1\t\tN/A
GPU3\tSYS\tSYS\tNV4\t X \tSYS\t32-63\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X \t\t\t\t

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
"""

#: A device column of the matrix: GPU0, NIC1, mlx5_0 (not "GPU NUMA ID").
DEVICE = re.compile(r"^(GPU\d+|NIC\d+|mlx\w+)$")


def _run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return ""
    return out.stdout if out.returncode == 0 else ""


def parse_topo_matrix(text: str) -> dict[str, dict[str, str]]:
    """Parse ``nvidia-smi topo -m`` into ``{row device: {column device: link}}``.

    Only the device-by-device block is kept (the affinity columns are read separately by
    :func:`parse_topo_affinity`); the legend below the matrix is ignored.
    """
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    header_at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("GPU0")), None)
    if header_at is None:
        return {}
    columns = [c for c in lines[header_at].split() if DEVICE.match(c)]
    matrix = {}
    for line in lines[header_at + 1 :]:
        cells = line.split()
        if not cells or not DEVICE.match(cells[0]) or len(cells) < len(columns) + 1:
            break
        matrix[cells[0]] = dict(zip(columns, cells[1 : len(columns) + 1], strict=True))
    return matrix


def parse_topo_affinity(text: str) -> dict[str, dict[str, str]]:
    """CPU and NUMA affinity of each GPU from ``nvidia-smi topo -m`` (columns after the matrix)."""
    lines = [line for line in text.splitlines() if line.strip()]
    header_at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("GPU0")), None)
    if header_at is None:
        return {}
    n_dev = len([c for c in lines[header_at].split() if DEVICE.match(c)])
    out = {}
    for line in lines[header_at + 1 : header_at + 1 + n_dev]:
        cells = line.split()
        if cells[0].startswith("GPU"):
            rest = cells[1 + n_dev :]
            out[cells[0]] = {
                "cpu_affinity": rest[0] if rest else "",
                "numa_affinity": rest[1] if len(rest) > 1 else "",
            }
    return out


def _gpus() -> list[dict[str, str]]:
    fields = "index,name,memory.total,pci.bus_id,driver_version"
    text = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"])
    return [
        dict(zip(fields.split(","), (c.strip() for c in line.split(",")), strict=False))
        for line in text.splitlines()
        if line.strip()
    ]


def _cpu() -> dict[str, object]:
    data = json.loads(_run(["lscpu", "-J"]) or '{"lscpu": []}')
    flat = {item["field"].rstrip(":"): item.get("data") for item in data.get("lscpu", [])}
    keep = [
        "Architecture",
        "Model name",
        "CPU(s)",
        "Thread(s) per core",
        "Core(s) per socket",
        "Socket(s)",
        "NUMA node(s)",
        "L1d cache",
        "L2 cache",
        "L3 cache",
    ]
    info: dict[str, object] = {k: flat.get(k) for k in keep if flat.get(k)}
    numa = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    info["numa_cpus"] = {n.name: (n / "cpulist").read_text().strip() for n in numa}
    info["usable_cpus"] = len(os.sched_getaffinity(0))
    return info


def collect() -> dict[str, object]:
    """This node's topology; GPU fields are empty on a CPU-only node."""
    topo = _run(["nvidia-smi", "topo", "-m"])
    return {
        "hostname": socket.gethostname(),
        "gpus": _gpus(),
        "gpu_links": parse_topo_matrix(topo),
        "gpu_affinity": parse_topo_affinity(topo),
        "cpu": _cpu(),
        "interfaces": _run(["ip", "-br", "addr"]).split("\n"),
        "hwloc": _run(["lstopo-no-graphics", "--no-io", "--of", "console"]),
    }


def load_reports(folder: str | Path) -> list[dict[str, object]]:
    """Every ``<host>.json`` written by ``topology_report.py``, sorted by host name."""
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Rows of strings as an aligned text table (first row is the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def matrix_rows(matrix: dict[str, dict[str, str]]) -> list[tuple[str, ...]]:
    """A link matrix as table rows, header first."""
    cols = list(matrix)
    return [("", *cols), *((row, *(matrix[row][c] for c in cols)) for row in cols)]


def compare(reports: list[dict[str, object]]) -> list[tuple[str, ...]]:
    """Rows ``(fact, value on node 1, value on node 2, ...)`` for a side-by-side table."""
    keys = [
        "Model name",
        "CPU(s)",
        "Socket(s)",
        "Core(s) per socket",
        "Thread(s) per core",
        "NUMA node(s)",
        "L2 cache",
        "L3 cache",
        "usable_cpus",
    ]
    rows = [("host", *(str(r["hostname"]) for r in reports))]
    rows.append(("GPUs", *(str(len(r["gpus"])) for r in reports)))
    rows += [(k, *(str(r["cpu"].get(k, "-")) for r in reports)) for k in keys]
    return rows
