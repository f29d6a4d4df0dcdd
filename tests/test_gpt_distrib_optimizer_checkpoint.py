"""--use-distributed-optimizer through ``pretrain``: checkpoints in both formats (exact resume, and
a run saved with dp 4 loaded with dp 2), and pipeline and context parallelism.

For each of ``--ckpt-format torch`` (the shards gathered whole on dp rank 0) and ``torch_dist``
(each rank's shard its chunk of its bucket, the bucket one row of a (tp, length) tensor): an uninterrupted fp32 run of 6
iterations on 4 gloo ranks (dp 4, both overlaps, small buckets) saves at 3 and 6; resumed from 3
with dp 4 it gives the same losses to the bit; resumed with dp 2 (2 micro-batches per rank, the
same global batch of 8) within 1e-5 (the sums run in another order). Loading it without the flag
is refused naming the flag. pp 2 x dp 2 and cp 2 x dp 2 give the plain optimizer's losses and
gradient norms.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from distlab.gpt.checkpointing import checkpointing
from distlab.gpt.memory.meters import MEMORY, MiB
from distlab.local_runs import prepare_data, spawn_pretrain
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
    for line in MEMORY.parse(full.log):  # each rank's report: 4 + 4 + 8/4 bytes per value
        n = line["values"]
        assert line["params_mib"] == pytest.approx(4 * n / MiB, abs=0.01)
        assert line["grads_mib"] == pytest.approx(4 * n / MiB, abs=0.01)  # the buffers (+ padding)
        assert line["optim_mib"] == pytest.approx(8 * n / 4 / MiB, abs=0.01)
    same = _resume_from_3(tmp_path / "full", tmp_path / "dp4", argv, 4)
    assert same.last["iterations"] == [4, 5, 6]
    assert same.last["losses"] == full.last["losses"][3:]
    assert same.last["grad_norms"] == full.last["grad_norms"][3:]
    half = _resume_from_3(tmp_path / "full", tmp_path / "dp2", argv, 2)
    assert "8 + 8/d = 12 bytes per parameter per rank" in half.log  # d = 2
    torch.testing.assert_close(
        torch.tensor(half.last["losses"]), torch.tensor(full.last["losses"][3:]), rtol=0, atol=1e-5
    )
    if fmt == "torch_dist":  # each of the 4 ranks wrote its own chunk of every bucket's moments
        folder = str(tmp_path / "full" / "iter_0000003")
        chunks = FileSystemReader(folder).read_metadata().state_dict_metadata
        chunks = chunks["optimizer.distrib.pp0.bucket0.exp_avg"].chunks  # row 0 of (tp, length): tp 1
        assert sorted(tuple(c.offsets) for c in chunks) == [(0, i * chunks[0].sizes[1]) for i in range(4)]
    plain = [*TINY, *data, *STEPS, "--ckpt-format", fmt]
    with pytest.raises(
        Exception, match="written with --use-distributed-optimizer|holds a distributed optimizer"
    ):
        _resume_from_3(tmp_path / "full", tmp_path / "plain", plain, 2)
    other = [*TINY, *data, *STEPS, *DISTOPT[:-1], "5000", "--ckpt-format", fmt]  # other buckets
    with pytest.raises(Exception, match="load it with the --ddp-bucket-size it was saved with"):
        _resume_from_3(tmp_path / "full", tmp_path / "buckets", other, 2)


@pytest.mark.parametrize(
    "layout",
    [["--pipeline-model-parallel-size", "2"], ["--context-parallel-size", "2"]],
    ids=["pp2-dp2", "cp2-dp2"],
)
def test_pipeline_and_context_parallel_equal_the_plain_optimizer(data, tmp_path, layout) -> None:
    """pp 2 (the tied embedding's two stages summed before its bucket's reduce-scatter) and cp 2
    (shards over the dp x cp group: d = 4), fp32: the losses and norms of the plain optimizer."""
    argv = [*TINY, *data, *STEPS, *layout, "--ddp-bucket-size", "3000"]
    plain = spawn_pretrain(argv, 4, tmp_path / "plain")
    mine = spawn_pretrain([*argv, "--use-distributed-optimizer"], 4, tmp_path / "distopt")
    d = 2 if layout[0].startswith("--pipeline") else 4
    assert f"8 + 8/d = {8 + 8 / d:g} bytes per parameter per rank" in mine.log
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(
            torch.tensor(mine.last[key]), torch.tensor(plain.last[key]), rtol=1e-5, atol=1e-5
        )
