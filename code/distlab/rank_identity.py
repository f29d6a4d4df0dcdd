"""Who each rank is, recorded at start: ``started_<rank>.json`` beside the flight-recorder dumps.

    {"rank": 3, "node": "gpu-node7", "pid": 81234,                     # every backend
     "gpu_uuid": "GPU-5f0c...", "pci_bus_id": "00000000:1B:00.0"}       # with CUDA only

A hang report names the node and process of a rank that wrote no dump; with GPUs it also names the
device, as ``nvidia-smi --query-gpu=uuid,pci.bus_id --format=csv`` shows it, so that an operator
drains the right one. Each rank writes its own file when the run starts, not at the dump: a frozen
rank writes nothing later. The name ends in ``.json``, not in digits, so PyTorch's analyzer
(``torchfrtrace``, which takes every file ending in a number for a dump) passes it by.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch

PATTERN = "started_*.json"


def gpu_identity(device: torch.device | None) -> dict[str, str]:
    """``gpu_uuid`` and ``pci_bus_id`` of a CUDA device, in nvidia-smi's spelling; {} for any
    other device (nothing CUDA-only runs on a CPU rank)."""
    if device is None or device.type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(device)
    uuid = str(props.uuid)
    bus = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    return {"gpu_uuid": uuid if uuid.startswith("GPU-") else f"GPU-{uuid}", "pci_bus_id": bus}


def identity(rank: int, device: torch.device | None = None) -> dict:
    """This process as a start record: rank, node, pid, and the GPU where there is one."""
    return {"rank": rank, "node": socket.gethostname(), "pid": os.getpid(), **gpu_identity(device)}


def record(folder: Path, me: dict) -> Path:
    """Write ``me`` as ``<folder>/started_<rank>.json`` (atomically: a reader never sees half)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"started_{me['rank']}.json"
    partial = folder / f".started-{me['rank']}.tmp"
    partial.write_text(json.dumps(me))
    partial.replace(target)
    return target


def read(folder: Path) -> dict[int, dict]:
    """rank -> its start record, for every ``started_<rank>.json`` in ``folder``."""
    found = {}
    for path in folder.glob(PATTERN):
        me = json.loads(path.read_text())
        found[int(me["rank"])] = me
    return found


def where(me: dict | None) -> str:
    """``gpu-node7 (pid 81234, GPU GPU-5f0c... at 00000000:1B:00.0)``; ``?`` without a record."""
    if me is None:
        return "?"
    gpu = f", GPU {me['gpu_uuid']} at {me['pci_bus_id']}" if me.get("gpu_uuid") else ""
    return f"{me['node']} (pid {me['pid']}{gpu})"


__all__ = ["PATTERN", "gpu_identity", "identity", "read", "record", "where"]
