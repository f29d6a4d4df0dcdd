"""Checkpoints of --use-distributed-optimizer in both formats: exact resume, and a run saved with
dp 4 loaded with dp 2.

For each of ``--ckpt-format torch`` (the shards gathered whole on dp rank 0) and ``torch_dist``
(each rank's shard a ``Shard(0)`` DTensor of its bucket): an uninterrupted fp32 run of 6
iterations on 4 gloo ranks (dp 4, both overlaps, small buckets) saves at 3 and 6; resumed from 3
with dp 4 it gives the same losses to the bit; resumed with dp 2 (2 micro-batches per rank, the
same global batch of 8) within 1e-5 (the sums run in another order). Loading it without the flag
is refused naming the flag.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from distlab.gpt.checkpointing import checkpointing
from distlab.gpt.tools.local_run import prepare_data, spawn_pretrain
from tests.test_gpt_training import TINY

pytestmark = pytest.mark.timeout(300)
STEPS = ["--global-batch-size", "8", "--train-iters", "6", "--lr-decay-iters", "6"]
DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--ddp-bucket-size", "3000"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=80).argv()


def _resume_from_3(ckpt: Path, tmp_path: Path, argv: list[str], world_size: int):
    """A folder holding only iteration 3 (the tracker naming it); train from there to 6."""
    folder = tmp_path / "ckpt"
    shutil.copytree(ckpt / "iter_0000003", folder / "iter_0000003")
    (folder / checkpointing.TRACKER).write_text("3")
    return spawn_pretrain([*argv, "--load", str(folder)], world_size, tmp_path / "run")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_exactly_and_with_half_the_data_parallel_ranks(data, tmp_path, fmt) -> None:
    argv = [*TINY, *data, *STEPS, *DISTOPT, "--ckpt-format", fmt]
    full = spawn_pretrain(
        [*argv, "--save", str(tmp_path / "full"), "--save-interval", "3"], 4, tmp_path / "f"
    )
    assert "8 + 8/d = 10 bytes per parameter per rank" in full.log  # fp32, d = 4
    same = _resume_from_3(tmp_path / "full", tmp_path / "dp4", argv, 4)
    assert same.last["iterations"] == [4, 5, 6]
    assert same.last["losses"] == full.last["losses"][3:]
    assert same.last["grad_norms"] == full.last["grad_norms"][3:]
    half = _resume_from_3(tmp_path / "full", tmp_path / "dp2", argv, 2)
    assert "8 + 8/d = 12 bytes per parameter per rank" in half.log  # d = 2
    torch.testing.assert_close(
        torch.tensor(half.last["losses"]), torch.tensor(full.last["losses"][3:]), rtol=0, atol=1e-5
    )
    plain = [*TINY, *data, *STEPS, "--ckpt-format", fmt]
    with pytest.raises(
        Exception, match="written with --use-distributed-optimizer|holds a distributed optimizer"
    ):
        _resume_from_3(tmp_path / "full", tmp_path / "plain", plain, 2)
