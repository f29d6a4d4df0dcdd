"""``--ckpt-format torch_dist`` (torch.distributed.checkpoint) and ``--async-save``: exact resume
of the plain engine and of FSDP2, resharding (2 FSDP2 ranks -> 1 plain rank), the asynchronous
save's files and losses, DCP's folder, the refusals (torch_dist is the default, as Megatron-LM's),
and a load that reads the format it finds, whatever the run saves in.

Three uninterrupted runs of 6 iterations on 2 gloo ranks save at iterations 3 and 6: plain, FSDP2,
FSDP2 with --async-save. Three runs then resume from iteration 3: the plain and the FSDP2 one each
in its own layout (the losses of iterations 4-6 equal to the bit), and the FSDP2 one in 1 plain
rank, which reads both ranks' rows of every DTensor (found equal to the bit too; asserted to 1e-5).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distlab.distributed import DistContext
from distlab.gpt.arguments import PretrainArgs, parse_args, validate_args
from distlab.gpt.arguments.to_configs import checkpoint_config, optimizer_config
from distlab.gpt.checkpointing import checkpointing, dist_checkpointing
from distlab.gpt.checkpointing.checkpointer import SAVED
from distlab.gpt.checkpointing.checkpointing import Snapshot
from distlab.gpt.layout import Layout
from distlab.gpt.optimizer.optimizer import build_optimizer
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_runs import RunResult, prepare_data, spawn_pretrain
from tests.conftest import run_gloo
from tests.test_gpt_training import TINY

pytestmark = pytest.mark.timeout(120)
STEPS = ["--global-batch-size", "4", "--train-iters", "6", "--lr-decay-iters", "6"]
DIST = ["--ckpt-format", "torch_dist"]
FSDP2 = ["--use-torch-fsdp2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=80).argv()


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict[str, tuple[Path, RunResult]]:
    """Uninterrupted runs, 2 ranks, torch_dist saves at 3 and 6: their checkpoint folder and result."""
    out = {}
    for name, flags in {"plain": [], "fsdp2": FSDP2, "async": [*FSDP2, "--async-save"]}.items():
        root = tmp_path_factory.mktemp(name)
        argv = [*TINY, *data, *STEPS, *DIST, *flags, "--save", str(root / "ckpt"), "--save-interval", "3"]
        out[name] = root / "ckpt", spawn_pretrain(argv, 2, root / "run")
    return out


def _resume_from_3(ckpt: Path, tmp_path: Path, argv: list[str], world_size: int) -> RunResult:
    """A folder holding only iteration 3 (the tracker naming it); train from there to 6."""
    folder = tmp_path / "ckpt"
    shutil.copytree(ckpt / "iter_0000003", folder / "iter_0000003")
    (folder / checkpointing.TRACKER).write_text("3")
    return spawn_pretrain([*argv, "--load", str(folder)], world_size, tmp_path / "run")


def _assert_equal(got: list[float], want: list[float], rtol: float = 0.0) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=rtol, atol=0)


def test_plain_engine_resumes_exactly(runs, data, tmp_path) -> None:
    ckpt, full = runs["plain"]
    rest = _resume_from_3(ckpt, tmp_path, [*TINY, *data, *STEPS, *DIST], 2)
    assert f"> loaded checkpoint from {tmp_path / 'ckpt'} at iteration 3" in rest.log
    assert rest.last["iterations"] == [4, 5, 6]
    _assert_equal(rest.last["losses"], full.last["losses"][3:])
    _assert_equal(rest.last["lrs"], full.last["lrs"][3:])


def test_fsdp2_resumes_exactly(runs, data, tmp_path) -> None:
    ckpt, full = runs["fsdp2"]
    rest = _resume_from_3(ckpt, tmp_path, [*TINY, *data, *STEPS, *DIST, *FSDP2], 2)
    assert rest.last["iterations"] == [4, 5, 6]
    _assert_equal(rest.last["losses"], full.last["losses"][3:])
    _assert_equal(rest.last["grad_norms"], full.last["grad_norms"][3:])


def test_fsdp2_checkpoint_of_2_ranks_loads_into_1_plain_rank(runs, data, tmp_path) -> None:
    ckpt, full = runs["fsdp2"]
    one = _resume_from_3(ckpt, tmp_path, [*TINY, *data, *STEPS, *DIST], 1)  # micro 2 x accumulation 2
    assert "micro batch 2 x data-parallel 1 x accumulation steps 2" in one.log
    _assert_equal(one.last["losses"], full.last["losses"][3:], rtol=1e-5)


def _pipeline_scenario(ctx: DistContext, root: str) -> None:
    """pp 2 on 2 ranks, each stage its own parameters: save, change everything, load back."""
    state = ParallelState.build(Layout(2, pp=2))
    args = PretrainArgs(save=root, load=root, ckpt_format="torch_dist", num_layers=2, hidden_size=16,
                        num_attention_heads=2, max_position_embeddings=8, lr=0.1,
                        pipeline_model_parallel_size=2)  # fmt: skip
    config = checkpoint_config(args)

    def build() -> tuple[GPTModel, torch.optim.Optimizer]:
        model = GPTModel(GPTConfig(2, 16, 2, 32, 8), state)
        return model, build_optimizer(model, optimizer_config(args))

    def perturbed() -> tuple[GPTModel, torch.optim.Optimizer]:
        model, optimizer = build()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        return model, optimizer

    model, optimizer = build()  # no step yet: only the model is saved (fp16 overflows, e.g.)
    dist_checkpointing.save_checkpoint(config, state, Snapshot(model, optimizer, {"scale": 8.0}, 1, 4))
    fresh, fresh_opt = perturbed()
    loaded = dist_checkpointing.load_checkpoint(config, state, fresh, fresh_opt)
    result = {"loaded": list(loaded), "no_state": not fresh_opt.state}
    result["model_1"] = all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )
    for p in model.parameters():  # one Adam step on made-up gradients
        p.grad = torch.randn_like(p)
    optimizer.step()
    dist_checkpointing.save_checkpoint(config, state, Snapshot(model, optimizer, None, 2, 8))
    fresh, fresh_opt = perturbed()
    dist_checkpointing.load_checkpoint(config, state, fresh, fresh_opt)
    result["model_2"] = all(
        torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )
    want, got = optimizer.state_dict(), fresh_opt.state_dict()
    result["groups"] = want["param_groups"] == got["param_groups"]
    result["moments"] = sorted(want["state"]) == sorted(got["state"]) and all(
        torch.equal(want["state"][i][k], got["state"][i][k]) for i in want["state"] for k in want["state"][i]
    )
    Path(root, f"rank{ctx.rank}.json").write_text(json.dumps(result))


def test_pipeline_stages_save_their_own_names(tmp_path) -> None:
    """Each stage saves its parameters under their names, the optimizer's param_groups by name too
    (``flatten_optimizer_state_dict``: by position, the stages' groups would share a key); an
    optimizer that never stepped is left out, and stays empty when loaded."""
    run_gloo(_pipeline_scenario, 2, str(tmp_path))
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["loaded"] == [1, 4, {"scale": 8.0}] and r["no_state"], r
        assert r["model_1"] and r["model_2"] and r["groups"] and r["moments"], r
    first = set(FileSystemReader(tmp_path / "iter_0000001").read_metadata().state_dict_metadata)
    assert not any(k.startswith("optimizer.") for k in first)
    keys = set(FileSystemReader(tmp_path / "iter_0000002").read_metadata().state_dict_metadata)
    for name in ("wte.weight", "output_weight"):  # the first stage's E and the last stage's copy
        assert {
            f"model.{name}",
            f"optimizer.state.{name}.exp_avg",
            f"optimizer.param_groups.{name}.lr",
        } <= keys


def _files(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))


def _leaves(tree: object, prefix: str = "") -> dict[str, object]:
    """``{"model.wte.weight": tensor, "optimizer.param_groups.0.lr": 0.003, ...}``."""
    if isinstance(tree, dict | list):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        return {k: v for key, sub in items for k, v in _leaves(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def test_async_save_writes_the_same_checkpoints(runs, tmp_path) -> None:
    (sync_ckpt, sync), (async_ckpt, asynchronous) = runs["fsdp2"], runs["async"]
    assert _files(async_ckpt) == _files(sync_ckpt)  # no .tmp left, the same DCP files
    assert (async_ckpt / checkpointing.TRACKER).read_text() == "6"
    _assert_equal(asynchronous.last["losses"], sync.last["losses"])  # training went on, unchanged
    for it in ("iter_0000003", "iter_0000006"):  # DCP's own reader, as one process: full tensors
        dcp_to_torch_save(sync_ckpt / it, tmp_path / f"sync_{it}.pt")
        dcp_to_torch_save(async_ckpt / it, tmp_path / f"async_{it}.pt")
        want, got = (
            _leaves(torch.load(tmp_path / f"{m}_{it}.pt", weights_only=False)) for m in ("sync", "async")
        )
        assert got.keys() == want.keys() and any(isinstance(v, torch.Tensor) for v in want.values())
        for key, value in want.items():
            assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    lines = SAVED.parse(asynchronous.logs[0])
    assert [(r["iteration"], r["format"], r.get("mode")) for r in lines] == [
        (3, "torch_dist", "async"),
        (6, "torch_dist", "async"),
    ]
    assert all(0 < r["blocking_ms"] <= r["total_ms"] for r in lines)
    (line,) = SAVED.parse(sync.logs[0])[-1:]
    assert "mode" not in line and line["blocking_ms"] == line["total_ms"]


def test_a_torch_dist_folder_is_dcps(runs) -> None:
    ckpt, _ = runs["plain"]
    assert _files(ckpt / "iter_0000006") == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt"]
    common = torch.load(ckpt / "iter_0000006" / "common.pt", weights_only=False)
    assert (common["iteration"], common["consumed_samples"]) == (6, 24)
    assert sorted(common["rng"]) == [(0, 0, 0), (0, 0, 1)]  # (tp, pp, dp) of every rank


def _errors(data: list[str], *flags: str, world_size: int = 2) -> str:
    args = parse_args([*TINY, *data, "--train-iters", "2", *flags])
    with pytest.raises(ValueError) as err:
        validate_args(args, world_size)
    return str(err.value)


def test_refusals_name_the_fix(runs, data, tmp_path) -> None:
    msg = _errors(data, *FSDP2, "--save", str(tmp_path), "--ckpt-format", "torch")
    assert (
        "--ckpt-format torch is one full copy written by data-parallel rank 0: use --ckpt-format torch_dist"
        in msg
    )
    default = parse_args([*TINY, *data, "--train-iters", "2", *FSDP2, "--save", str(tmp_path)])
    assert default.ckpt_format == "torch_dist"  # Megatron-LM's default: FSDP2 saves with it as it is
    validate_args(default, 2)
    validate_args(parse_args([*TINY, *data, "--train-iters", "2", *FSDP2, *DIST, "--load", str(tmp_path)]), 2)
    msg = _errors(data, "--async-save", "--save", str(tmp_path), "--ckpt-format", "torch")
    assert (
        "--async-save with --ckpt-format torch: " in msg
        and "use --ckpt-format torch_dist (the default)" in msg
    )
    assert "--async-save was given without --save DIR" in _errors(data, *DIST, "--async-save")
    tp2 = [
        *TINY,
        *data,
        "--train-iters",
        "2",
        *DIST,
        "--save",
        str(tmp_path),
        "--tensor-model-parallel-size",
        "2",
    ]
    validate_args(parse_args(tp2), 2)  # the hand-written tp's shards placed in whole tensors (tp_chunks)
    # each reader, given a folder of the other format, names it and the reader of it
    single = ParallelState(Layout(1), rank=0)
    dist_ckpt, _ = runs["plain"]
    args = parse_args([*TINY, "--load", str(dist_ckpt)])
    with pytest.raises(
        FileNotFoundError,
        match="written with --ckpt-format torch_dist .*: dist_checkpointing.load_checkpoint",
    ):
        checkpointing.load_checkpoint(checkpoint_config(args), single, None, None)
    (tmp_path / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / checkpointing.TRACKER).write_text("1")
    args = parse_args([*TINY, *DIST, "--load", str(tmp_path)])
    with pytest.raises(
        FileNotFoundError, match="written with --ckpt-format torch; checkpointing.load_checkpoint reads it"
    ):
        dist_checkpointing.load_checkpoint(checkpoint_config(args), single, None, None)


def test_a_load_reads_the_format_it_finds(runs, data, tmp_path) -> None:
    """As Megatron-LM's: --ckpt-format is the saves' format, --load reads the folder's own. A
    torch_dist checkpoint resumes a run that saves torch (the same losses); that run's torch
    checkpoint continues in a run that saves torch_dist; FSDP2 refuses a torch one, naming the fix."""
    ckpt, full = runs["plain"]
    torch_ckpt = tmp_path / "to_torch" / "ckpt"  # iteration 3 copied there; the run adds 6
    legacy = [*TINY, *data, *STEPS, "--ckpt-format", "torch", "--save", str(torch_ckpt)]
    rest = _resume_from_3(ckpt, tmp_path / "to_torch", legacy, 2)
    _assert_equal(rest.last["losses"], full.last["losses"][3:])
    assert checkpointing.saved_format(str(torch_ckpt)) == "torch"  # the tracker names 6
    assert checkpointing.saved_format(str(ckpt)) == "torch_dist"
    more = ["--train-iters", "7", "--load", str(torch_ckpt), "--save", str(tmp_path / "dist")]
    back = spawn_pretrain([*TINY, *data, *STEPS, *DIST, *more], 2, tmp_path / "back")
    assert back.last["iterations"] == [7] and (tmp_path / "dist" / "iter_0000007" / ".metadata").exists()
    fsdp2 = [*TINY, *data, *STEPS, *DIST, *FSDP2, "--load", str(torch_ckpt)]
    with pytest.raises(Exception, match="parameters are DTensors .* load it in a run without those flags"):
        spawn_pretrain(fsdp2, 2, tmp_path / "fsdp2")
