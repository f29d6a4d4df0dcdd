"""Runs that make no DTensor do not import ``torch.distributed.tensor``.

Importing it costs about 0.5 s of CPU in every process (it pulls in sympy through torch.fx), paid by
every rank of every notebook job, restarts included. ``optimizer.is_dtensor`` answers
``isinstance(t, DTensor)`` from ``sys.modules``: a DTensor exists only once the package is imported.
Each case runs in a fresh interpreter, so that no other test's imports count.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine_fast

PLAIN = """
import sys, torch
import distlab.gpt.pretrain
from distlab.gpt.memory import meters
from distlab.gpt.optimizer.optimizer import is_dtensor
t = torch.ones(4)
print("torch.distributed.tensor" in sys.modules, is_dtensor(t), meters._local(t) is t)
"""

SHARDED = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from distlab.gpt.memory import meters
from distlab.gpt.optimizer.optimizer import is_dtensor
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
local = torch.arange(6.0)
d = DTensor.from_local(local, init_device_mesh("cpu", (1,)), [Shard(0)])
print(is_dtensor(d), is_dtensor(local), meters._local(d).data_ptr() == local.data_ptr())
dist.destroy_process_group()
"""


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split("\n")[-2]


def test_a_plain_run_does_not_import_dtensor() -> None:
    assert run(PLAIN) == "False False True"


def test_a_dtensor_is_recognised_once_its_package_is_imported() -> None:
    assert run(SHARDED) == "True False True"
