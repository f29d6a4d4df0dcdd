"""Checkpoints: Megatron layout, a save killed half-way never becomes the latest, mismatches named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab.distributed import DistContext
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.checkpointing import checkpointing
from distlab.gpt.checkpointing.checkpointing import Snapshot
from distlab.gpt.layout import Layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.transformer.model import GPTConfig, GPTModel
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(120)


def _args(root: str, **kw) -> PretrainArgs:
    shape = dict(num_layers=1, hidden_size=16, num_attention_heads=2, max_position_embeddings=8) | kw
    return PretrainArgs(save=root, load=root, **shape)


def _scenario(ctx: DistContext, root: str) -> None:
    rank = ctx.rank
    state = ParallelState.build(Layout(dist.get_world_size()))
    args = _args(root)
    model = GPTModel(GPTConfig(1, 16, 2, 32, 8, seed=rank), state)  # different on purpose: dp rank 0 saves
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)).mean().backward()
    opt.step()
    checkpointing.save_checkpoint(
        args, state, Snapshot(model, opt, {"scale": 8.0}, iteration=1, consumed_samples=4)
    )
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    real_save = torch.save

    def dying_save(obj, path, *a, **k):  # the job is killed while writing the file
        Path(path).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt("killed during save")

    torch.save = dying_save
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpointing.save_checkpoint(
                args, state, Snapshot(model, opt, None, iteration=2, consumed_samples=8)
            )
    finally:
        torch.save = real_save
    dist.barrier()
    result = {
        "tracker": checkpointing.read_tracker(root),
        "iter2": os.path.exists(f"{root}/iter_0000002"),
    }
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    iteration, consumed, scaler = checkpointing.load_checkpoint(args, state, model, opt)
    result.update(iteration=iteration, consumed=consumed, scaler=scaler)
    result["restored"] = all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    try:
        checkpointing.load_checkpoint(_args(root, hidden_size=32), state, model, opt)
    except ValueError as exc:
        result["mismatch"] = str(exc)
    Path(root, f"result{rank}.json").write_text(json.dumps(result))


def test_killed_save_keeps_the_previous_checkpoint_latest(tmp_path):
    run_gloo(_scenario, 1, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["iter_0000001", "iter_0000002.tmp"]
    assert (tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt").exists()
    r = json.loads((tmp_path / "result0.json").read_text())  # the run after the "kill"
    assert r["tracker"] == 1 and not r["iter2"]
    assert (r["iteration"], r["consumed"], r["scaler"]) == (1, 4, {"scale": 8.0})
    assert r["restored"]
    assert "--hidden-size 16 (checkpoint) vs 32 (now)" in r["mismatch"]


def test_missing_folder_means_fresh_start(tmp_path):
    assert checkpointing.read_tracker(str(tmp_path / "none")) is None
    (tmp_path / checkpointing.TRACKER).write_text("oops")
    with pytest.raises(ValueError, match="holds 'oops'"):
        checkpointing.read_tracker(str(tmp_path))
