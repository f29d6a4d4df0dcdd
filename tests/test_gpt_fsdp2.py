"""PyTorch's FSDP2 back end (``--use-torch-fsdp2``) against the plain engine, and its refusals.

One 1-process plain run (4 micro-batches of 2 per step) is the reference. One spawned group of 2
gloo ranks then trains the same GPT on the same global batches (2 micro-batches per rank and step,
so gradient accumulation runs without and then with the reduce-scatter) with FSDP2 four ways:
reshard_after_forward True and False, CPUOffloadPolicy, and MixedPrecisionPolicy bf16, with the
residual stream in bf16 and, with --fp32-residual-connection, in fp32 (the blocks' inputs then
not cast by the policy). In fp32 FSDP2 is the plain step's arithmetic reordered (all-gather,
reduce-scatter of the same sums): the losses agree to fp32 rounding (found: within one ulp, 8e-8
relative), the grad norms too (1.1e-7). bf16 parameters and compute move the losses by about 2e-4
over 3 steps.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from distlab.distributed import DistContext
from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.memory.meters import MEMORY
from distlab.local_runs import prepare_data, spawn_pretrain
from tests.conftest import run_gloo
from tests.test_gpt_training import TINY

pytestmark = pytest.mark.timeout(120)
STEPS = ["--global-batch-size", "8", "--train-iters", "3", "--lr-decay-iters", "3"]
FSDP2 = {  # name: the flags after --use-torch-fsdp2
    "reshard": [],
    "no_reshard": ["--torch-fsdp2-no-reshard-after-forward"],  # Megatron-LM's spelling
    "cpu_offload": ["--torch-fsdp2-cpu-offload"],
    "bf16": ["--bf16"],
    "bf16_fp32_residual": ["--bf16", "--fp32-residual-connection"],
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=80).argv()


def train_in_group(ctx: DistContext, argv: list[str]) -> tuple:
    """build_run and train in this rank's existing group (no new process group per run): the
    run, its history and what it printed."""
    from distlab.gpt.build import build_run
    from distlab.gpt.pretrain import train

    args = parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run = build_run(args, validate_args(args, ctx.world_size), ctx)
        history = train(run)
    return run, history, out.getvalue()


def _train(ctx: DistContext, argv: list[str]) -> dict:
    from torch.distributed.tensor import DTensor

    from distlab.gpt.memory.meters import memory_stats
    from distlab.gpt.native import fsdp2

    run, history, log = train_in_group(ctx, argv)
    params = [p for g in run.optimizer.param_groups for p in g["params"]]
    native = torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()  # DTensor's own
    run.backend.close()
    residual: set[str] = set()  # the dtype each block receives, after FSDP2's own pre-hook
    hooks = [block.register_forward_pre_hook(lambda m, a, kw: residual.add(str(a[0].dtype)), with_kwargs=True)
             for block in run.model.layers.values()]  # fmt: skip
    with torch.no_grad():
        run.model(torch.zeros(2, 32, dtype=torch.long))  # tokens (b, T)
    for hook in hooks:
        hook.remove()
    run.model.reshard()  # the last forward left the root's parameters gathered
    return {
        "losses": history["losses"],
        "grad_norms": history["grad_norms"],
        "log": log,
        "memory": memory_stats(run.model, run.optimizer, ctx.device),
        "tensors": len(params),
        "optimizer_on_shards": all(isinstance(p, DTensor) for p in params),
        "norm": [float(fsdp2.grad_norm(params)), float(native)],
        "residual": sorted(residual),
    }


def _worker(ctx: DistContext, argv: list[str], out: str) -> None:
    results = {name: _train(ctx, [*argv, "--use-torch-fsdp2", *flags]) for name, flags in FSDP2.items()}
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> tuple[dict, list[dict]]:
    root = tmp_path_factory.mktemp("fsdp2")
    argv = [*TINY, *data, *STEPS]
    plain = spawn_pretrain(argv, 1, root / "plain")
    run_gloo(_worker, 2, argv, str(root), timeout_s=120)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    return {"losses": plain.last["losses"], "grad_norms": plain.last["grad_norms"], "log": plain.log}, ranks


@pytest.mark.parametrize("name", ["reshard", "no_reshard", "cpu_offload"])
def test_fp32_equals_the_plain_run(runs, name: str) -> None:
    plain, ranks = runs
    run = ranks[1][name]
    assert ranks[0][name]["losses"] == run["losses"]  # every rank reports the mean over dp
    assert "micro batch 2 x data-parallel 2 x accumulation steps 2" in ranks[0][name]["log"]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        torch.tensor(run["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-6, atol=0
    )
    assert run["optimizer_on_shards"]  # the optimizer was built after fully_shard
    assert run["norm"][0] == pytest.approx(run["norm"][1], rel=1e-6)  # = get_total_norm of the DTensors


def test_start_up_lines_name_the_policies(runs) -> None:
    _, ranks = runs
    log = ranks[0]["no_reshard"]["log"]
    assert "> torch FSDP2: fully_shard on each of 2 blocks, then the root, over a 1-D DeviceMesh of 2" in log
    assert "reshard_after_forward=False for the blocks; fp32 throughout; CPUOffloadPolicy off" in log
    assert "CPUOffloadPolicy on" in ranks[0]["cpu_offload"]["log"]
    bf16 = ranks[0]["bf16"]["log"]
    assert "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" in bf16
    assert "precision: bf16 parameters and compute on cpu (FSDP2's MixedPrecisionPolicy, no autocast)" in bf16


def test_memory_line_shows_half_per_rank(runs) -> None:
    plain, ranks = runs
    (full,) = MEMORY.parse(plain["log"])
    lines = MEMORY.parse(ranks[0]["reshard"]["log"])  # rank 0 prints every rank's line
    assert len(lines) == 2
    for line in lines:
        assert line["values"] == full["values"]  # a DTensor's numel() is the whole parameter's
        for key in ("params_mib", "grads_mib", "optim_mib"):
            assert line[key] == pytest.approx(full[key] / 2, abs=0.006), key  # printed to 0.01 MiB
    for rank in ranks:  # the exact bytes: every dimension of the tiny GPT is even
        mem = rank["reshard"]["memory"]
        assert 2 * mem["parameters"] == 4 * mem["num_parameters"] == 2 * mem["gradients"]
        assert mem["optimizer_state"] == 2 * mem["parameters"] + 4 * rank["reshard"]["tensors"]  # + steps


@pytest.mark.parametrize(
    "name, residual, line",
    [
        ("bf16", "torch.bfloat16", "residual stream in bf16"),
        ("bf16_fp32_residual", "torch.float32", "residual stream in fp32 (--fp32-residual-connection)"),
    ],
)
def test_bf16_mixed_precision_trains_close_to_fp32(runs, name: str, residual: str, line: str) -> None:
    plain, ranks = runs
    bf16 = ranks[1][name]
    assert all(torch.isfinite(torch.tensor(bf16["losses"])))
    assert bf16["losses"][-1] < bf16["losses"][0]
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=0.01)
    assert [rank[name]["residual"] for rank in ranks] == [[residual]] * 2  # what the blocks receive
    assert line in ranks[0][name]["log"]


def _refusal(data: list[str], *flags: str, world_size: int = 4) -> str:
    args = parse_args([*TINY, *data, "--train-iters", "2", "--use-torch-fsdp2", *flags])
    with pytest.raises(ValueError) as err:
        validate_args(args, world_size)
    return str(err.value)


def test_refusals_name_the_values(data, tmp_path) -> None:
    msg = _refusal(data, "--tensor-model-parallel-size", "2")
    assert (
        "--tensor-model-parallel-size 2 (--tensor-parallel-impl megatron) and --pipeline-model-parallel-size 1"
        in msg
    )
    assert "set pp to 1, and tp to 1 or add --tensor-parallel-impl dtensor" in msg
    msg = _refusal(data, "--pipeline-model-parallel-size", "2")
    assert (
        "--tensor-model-parallel-size 1 (--tensor-parallel-impl megatron) and --pipeline-model-parallel-size 2"
        in msg
    )
    assert "--use-torch-fsdp2 and --deepspeed were both given" in _refusal(data, "--deepspeed")
    legacy = _refusal(data, "--save", str(tmp_path), "--ckpt-format", "torch")
    assert (
        f"--use-torch-fsdp2 with --save {tmp_path}: " in legacy and "use --ckpt-format torch_dist" in legacy
    )
    assert "use --bf16" in _refusal(data, "--fp16")
    args = parse_args([*TINY, *data, "--train-iters", "2", "--torch-fsdp2-cpu-offload"])
    with pytest.raises(ValueError, match="--torch-fsdp2-cpu-offload was given without --use-torch-fsdp2"):
        validate_args(args, 2)
    assert (
        parse_args([*TINY, "--torch-fsdp2-no-reshard-after-forward"]).torch_fsdp2_reshard_after_forward
        is False
    )
    assert (
        parse_args([*TINY, "--torch-fsdp2-reshard-after-forward", "False"]).torch_fsdp2_reshard_after_forward
        is False
    )
