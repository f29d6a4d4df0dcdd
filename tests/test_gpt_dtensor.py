"""DTensor tensor parallelism (``--tensor-parallel-impl dtensor``) against one process, the
hand-written TP, and its collectives.

One 1-process run (4 micro-batches of 2 per step) is the reference. A group of 2 gloo ranks
trains the same GPT on the same global batches with TP 2 three ways (DTensor, DTensor + SP, the
engine's Megatron layers) and counts, with ``CommDebugMode``, the collectives of one block's
forward and backward under each; a group of 4 ranks trains FSDP2 (dp 2) x DTensor TP 2, with and
without SP, on the 2-D mesh. In fp32 every run is the reference's arithmetic regrouped: losses
agree within 1e-6 (relative).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from distlab.distributed import DistContext
from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.checkpointing import checkpointing
from distlab.gpt.native.dtensor_parallel import as_nn_linear, check_plan
from distlab.gpt.native.plan_check import block_collectives, plan_is_right, try_mlp_plan
from distlab.gpt.tensor_parallel.layers import VOCAB_PADDING
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_runs import prepare_data, spawn_pretrain
from distlab.logs.megatron import parameter_counts
from tests.conftest import run_gloo
from tests.test_gpt_fsdp2 import train_in_group
from tests.test_gpt_training import TINY

pytestmark = pytest.mark.timeout(300)
STEPS = ["--global-batch-size", "8", "--train-iters", "2", "--lr-decay-iters", "2"]
DIST = ["--ckpt-format", "torch_dist"]
TP2 = ["--tensor-model-parallel-size", "2"]
DTENSOR = [*TP2, "--tensor-parallel-impl", "dtensor"]
RUNS_2 = {"dtensor": DTENSOR, "dtensor_sp": [*DTENSOR, "--sequence-parallel"], "megatron": TP2}
RUNS_4 = {
    "fsdp2_x_dtensor": [*DTENSOR, "--use-torch-fsdp2"],
    "fsdp2_x_dtensor_sp": [*DTENSOR, "--use-torch-fsdp2", "--sequence-parallel"],
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=80).argv()


def _block_collectives(run) -> dict[str, int]:
    """Collectives of block 1's forward and backward on one (b, T, H) input, by kind (block 0
    under SP also cuts the sequence: the embeddings' output is whole)."""
    args = run.args
    x = torch.randn(args.micro_batch_size, args.seq_length, args.hidden_size)
    if args.sequence_parallel:  # the residual stream between blocks is this rank's T / tp slice
        x = x.chunk(run.layout.tp, dim=1)[run.state.tp_rank]
    run.backend.zero_grad()  # a Partial gradient added to a whole one would be all-reduced
    return block_collectives(run.model.layers["1"], x)


def _train(ctx: DistContext, argv: list[str]) -> dict:
    """The losses, the log and one block's collectives of a run in this rank's group."""
    run, history, log = train_in_group(ctx, argv)
    return {
        "losses": history["losses"],
        "grad_norms": history["grad_norms"],
        "log": log,
        "block": _block_collectives(run),
    }


def _worker(ctx: DistContext, argv: list[str], runs: dict[str, list[str]], out: str) -> None:
    from distlab.gpt.layout import Layout
    from distlab.gpt.native.dtensor_parallel import device_mesh

    results = {name: _train(ctx, [*argv, *flags]) for name, flags in runs.items()}
    try:  # a layout for another world size: refused before a group is made
        device_mesh(Layout(2 * ctx.world_size, tp=2), ctx.device)
    except ValueError as exc:
        results["mesh_error"] = str(exc)
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> tuple[dict, dict]:
    """The reference; 4 ranks (FSDP2 x TP saves at iterations 1 and 2); 2 ranks, one of which
    resumes from that iteration 1 with TP 2 alone; one process resuming from it too."""
    root = tmp_path_factory.mktemp("dtensor")
    argv = [*TINY, *data, *STEPS]
    plain = spawn_pretrain(argv, 1, root / "plain")
    saved = [*DIST, "--save", str(root / "ckpt"), "--save-interval", "1"]
    resume = [*DIST, "--load", str(root / "from_1")]
    runs_4 = {
        name: [*flags, *saved] if name == "fsdp2_x_dtensor" else flags for name, flags in RUNS_4.items()
    }
    results = {}
    for world, named in ((4, runs_4), (2, RUNS_2 | {"dtensor_resumed": [*DTENSOR, *resume]})):
        if world == 2:  # a folder holding iteration 1 only
            shutil.copytree(root / "ckpt" / "iter_0000001", root / "from_1" / "iter_0000001")
            (root / "from_1" / checkpointing.TRACKER).write_text("1")
        folder = root / str(world)
        folder.mkdir()
        run_gloo(_worker, world, argv, named, str(folder), timeout_s=240)
        results[world] = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]
    one = spawn_pretrain([*argv, *resume], 1, root / "one_resumed")
    results[1] = [{"resumed": {"losses": one.last["losses"], "log": one.log}}]
    return {"losses": plain.last["losses"], "grad_norms": plain.last["grad_norms"]}, results


@pytest.mark.parametrize(("world", "name"), [(2, n) for n in RUNS_2] + [(4, n) for n in RUNS_4])
def test_losses_equal_one_process(runs, world: int, name: str) -> None:
    plain, results = runs
    last = results[world][-1][name]  # the last rank prints the loss
    assert len(last["losses"]) == 2
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        torch.tensor(last["grad_norms"]), torch.tensor(plain["grad_norms"]), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize(("world", "name"), [(2, "dtensor_resumed"), (1, "resumed")])
def test_a_2d_checkpoint_resumes_in_another_layout(runs, world: int, name: str) -> None:
    """Saved by FSDP2 (dp 2) x TP 2 on 4 ranks, loaded by TP 2 alone on 2 ranks, and by 1 process:
    DCP cuts the DTensor shards for the loading layout; iteration 2 is the uninterrupted one's."""
    plain, results = runs
    resumed, log = results[world][-1][name], results[world][0][name]["log"]  # rank 0 prints the start-up
    assert "> loaded checkpoint from" in log and "at iteration 1" in log
    assert len(resumed["losses"]) == 1
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(plain["losses"][1:]), rtol=1e-6, atol=0
    )
    saved = results[4][-1]["fsdp2_x_dtensor"]
    torch.testing.assert_close(
        torch.tensor(saved["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=0
    )


def test_collectives_match_the_hand_written_f_and_g(runs) -> None:
    _, results = runs
    ranks = results[2]
    for rank in ranks:
        assert rank["megatron"]["block"] == {"all_reduce": 4}  # f, g around attention and MLP, fwd + bwd
        assert rank["dtensor"]["block"] == rank["megatron"]["block"]
        assert rank["dtensor_sp"]["block"] == {"all_gather": 4, "reduce_scatter": 4}  # g, g-bar: same bytes
    for rank in results[4]:
        assert rank["fsdp2_x_dtensor"]["block"]["all_reduce"] == 4  # TP's, beside FSDP's gathers


def test_start_up_lines_show_the_mesh_and_the_plan(runs) -> None:
    _, results = runs
    log = results[4][0]["fsdp2_x_dtensor_sp"]["log"]
    assert "> DeviceMesh pp 1 x dp 2 x tp 2 (cpu), ranks by (pp, dp, tp): [[[0, 1], [2, 3]]]" in log
    assert (
        "> DTensor tensor parallelism: parallelize_module over mesh['tp'] of 2 ranks: ColwiseParallel on "
        "attn.qkv, mlp.fc1; SequenceParallel on ln1, ln2; PrepareModuleInput on attn, mlp, layers.0, ln_f; "
        "RowwiseParallel on attn.proj, mlp.fc2"
    ) in log
    assert "> torch FSDP2: fully_shard on each of 2 blocks, then the root, over a 1-D DeviceMesh of 2" in log


def test_parameter_count_is_this_ranks_shard(runs) -> None:
    """Every tp rank prints the values it holds (DTensor local shards, before FSDP2 splits them
    over dp): the blocks split as by the hand-written TP, whose vocabulary-parallel embedding
    keeps V H / 2 of E on each rank where the plan keeps E whole: V H / 2 more here."""
    _, results = runs
    hidden = int(TINY[TINY.index("--hidden-size") + 1])
    for tp_rank in (0, 1):
        logs = {name: results[2][tp_rank][name]["log"] for name in ("dtensor", "megatron")}
        vocab = VOCAB_PADDING.parse(results[2][0]["megatron"]["log"])[0]["padded"]
        counts = {name: parameter_counts(log) for name, log in logs.items()}
        assert list(counts["dtensor"]) == [(tp_rank, 0)]
        assert counts["dtensor"][tp_rank, 0] - counts["megatron"][tp_rank, 0] == vocab * hidden // 2
        fsdp = parameter_counts(results[4][tp_rank]["fsdp2_x_dtensor"]["log"])  # dp rank 0, tp rank t
        assert fsdp == counts["dtensor"]


def test_refusals_name_the_values(data, runs) -> None:
    _, results = runs
    msg = results[2][0]["mesh_error"]
    assert "a DeviceMesh of pp 1 x dp 2 x tp 2 = 4 ranks does not match the world size 2" in msg
    assert "launch 4 processes" in msg

    model = GPTModel(GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64,
                               max_position_embeddings=8, ffn_hidden_size=100))  # fmt: skip
    as_nn_linear(model)
    with pytest.raises(ValueError, match=r"ColwiseParallel on layers.0.mlp.fc1 shards weight dim 0 of size "
                       r"100 over tp 3 \(100 % 3 = 1\): choose a tensor-parallel size"):  # fmt: skip
        check_plan(model, {"layers.0.mlp.fc1": ColwiseParallel()}, 3)

    def refusal(*flags: str, world_size: int = 4) -> str:
        args = parse_args([*TINY, *data, "--train-iters", "2", *flags])
        with pytest.raises(ValueError) as err:
            validate_args(args, world_size)
        return str(err.value)

    assert "data-parallel size 2 (world 4 / tp 2): DTensor runs reduce" in refusal(*DTENSOR)
    assert "add --use-torch-fsdp2 (FSDP x TP on a 2-D mesh) or launch 2 processes" in refusal(*DTENSOR)
    msg = refusal(*DTENSOR, "--pipeline-model-parallel-size", "2", "--use-torch-fsdp2", world_size=8)
    assert "--tensor-parallel-impl dtensor with --pipeline-model-parallel-size 2" in msg


@pytest.mark.parametrize(
    ("fc1", "fc2", "right"),
    [(ColwiseParallel, RowwiseParallel, True), (ColwiseParallel, ColwiseParallel, False)],
)
def test_the_notebook_exercise_check_passes_the_answer_only(fc1, fc2, right: bool) -> None:
    """Notebook 08's check: Megatron's split passes (losses of one process, 4 all-reduces per
    block); Colwise twice is refused by PyTorch's sharding propagation and fails the check."""
    result = try_mlp_plan({"fc1": fc1(), "fc2": fc2()}, steps=2)
    assert plan_is_right(result) is right, result
    if right:
        assert result["collectives"] == {"all_reduce": 4} and len(result["losses"]) == 2
    else:
        assert result["error"] and result["losses"] is None
