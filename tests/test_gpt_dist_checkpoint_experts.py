"""``--ckpt-format torch_dist`` with expert parallelism, through the whole driver.

A tiny MoE GPT (2 layers, hidden 32, 4 heads, sequence 16, 4 experts, top-2, aux loss coeff 1e-2,
global batch 8 of micro-batches of 2) trains 3 iterations in fp32 in each layout below; a run of
2 iterations (the LR schedule of 3) saves, and a run loading it computes the third, which must
equal the uninterrupted run's to the bit (loss, gradient norm, [moe] tokens per expert)::

    ep 2 x dp 4 (edp 2), distributed optimizer, both overlaps, small buckets: each ep rank's expert
        buckets under keys of its own (``pp0.ep<e>.bucket<i>``), written by its 2 edp ranks; also
        resumed on 2 ranks (ep 2 x dp 2, edp 1: DCP reshards the buckets), within 1e-5
    tp 2 (sequence parallel) x ep 2 (dp 2), distributed optimizer, alltoall: the experts' tp shards
        placed in their one-process tensors
    pp 2 x ep 2 (dp 2), distributed optimizer, a Llama-MoE (RMSNorm, RoPE, SwiGLU experts without
        biases, 2 query groups, untied): each stage's buckets, dense and expert
    ep 2 (dp 2), plain optimizer: resumed at ep 1 (every expert on each rank: the experts' names
        are global) and at ep 4 x dp 4 as well, within 1e-5

Loading the distributed optimizer's state at another ep is refused naming the flag and
--no-load-optim. The Llama-MoE's run saved in the legacy format too (a file per (tp, pp, ep) rank)
reads back whole (``convert_checkpoint.py``'s and ``generate.py``'s reader) as the torch_dist one.
Before the expert buckets were keyed by ep rank, the ep ranks wrote one key with different data,
DCP kept one rank's, and the resume went on without an error from the wrong experts' main
parameters and moments (another loss).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from distlab.gpt.inference import course_checkpoint
from distlab.local_ranks import spawn_ranks
from distlab.local_runs import prepare_data, spawn_pretrain
from tests.conftest import train_plan

pytestmark = pytest.mark.timeout(400)

TOL = 1e-5  # another dp (or ep): fp32 sums in another order
MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 "
    "--make-vocab-size-divisible-by 128 --seed 1234 --split 949,50,1 --log-interval 1 "
    "--eval-interval 3 --eval-iters 1 --distributed-backend gloo --ckpt-format torch_dist "
    "--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
    "--attention-dropout 0 --hidden-dropout 0"  # runs of other layouts draw other masks
).split()
DISTOPT = "--use-distributed-optimizer --ddp-bucket-size 3000"
LLAMA = (
    "--normalization RMSNorm --position-embedding-type rope --swiglu --group-query-attention "
    "--num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights"
)
#: layout: (world, flags); each is run uninterrupted, saved at 2, and resumed
LAYOUTS = {
    "ep2-dp4": (4, f"--expert-model-parallel-size 2 {DISTOPT} --overlap-grad-reduce --overlap-param-gather"),
    "tp2-ep2": (4, f"--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 {DISTOPT} "
                   "--moe-token-dispatcher-type alltoall"),
    "pp2-ep2": (4, f"{LLAMA} --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 {DISTOPT}"),
    "ep2-plain": (2, "--expert-model-parallel-size 2"),
}  # fmt: skip
#: more loads of a layout's checkpoint: name: (layout, world, flags)
RESHARDED = {
    "ep2-dp4-resume-world2": ("ep2-dp4", 2, LAYOUTS["ep2-dp4"][1]),
    "ep2-plain-resume-ep1": ("ep2-plain", 2, ""),
    "ep2-plain-resume-ep4": ("ep2-plain", 4, "--expert-model-parallel-size 4"),
}


def _plan(ckpt: Path, data: list[str]) -> list:
    """``train_plan``'s runs, each port picked when its run starts (None)."""
    plan = []
    for name, (world, flags) in LAYOUTS.items():
        argv = [*MODEL, *data, *flags.split()]
        plan += [
            (name, world, argv, None),
            (f"{name}-save", world, [*argv, "--train-iters", "2", "--lr-decay-iters", "3", "--save", str(ckpt / name)],
             None),
            (f"{name}-resume", world, [*argv, "--lr-decay-iters", "3", "--load", str(ckpt / name)], None),
        ]  # fmt: skip
    for name, (layout, world, flags) in RESHARDED.items():
        argv = [*MODEL, *data, *flags.split(), "--lr-decay-iters", "3", "--load", str(ckpt / layout)]
        plan.append((name, world, argv, None))
    legacy = ["--train-iters", "2", "--lr-decay-iters", "3", "--ckpt-format", "torch"]  # the save run's
    legacy += ["--save", str(ckpt / "pp2-ep2-torch")]
    plan.append(("pp2-ep2-torch", 4, [*MODEL, *data, *LAYOUTS["pp2-ep2"][1].split(), *legacy], None))
    return plan


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("dist_ckpt_ep")
    data = prepare_data(base / "data", vocab_size=512, max_files=40).argv()
    spawn_ranks(train_plan, (_plan(base / "ckpt", data), str(base)), 4)
    return base


def _last(folder: Path, name: str, world: int) -> dict:
    """The history of the run's last rank (the one that logs, the last pipeline stage's)."""
    return json.loads((folder / f"{name}.rank{world - 1}.json").read_text())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resumes_the_uninterrupted_run_exactly(runs: Path, name: str) -> None:
    world = LAYOUTS[name][0]
    whole, resumed = _last(runs, name, world), _last(runs, f"{name}-resume", world)
    assert len(whole["losses"]) == 3 and len(resumed["losses"]) == 1  # iteration 3 only
    for key in ("losses", "grad_norms"):
        assert resumed[key][0] == whole[key][2], (name, key, resumed[key], whole[key])
    assert resumed["moe"][0]["layers"] == whole["moe"][2]["layers"]
    assert "in torch_dist format" in (runs / f"{name}-save.rank0.log").read_text()
    log = (runs / f"{name}-resume.rank0.log").read_text()
    assert f"> loaded checkpoint from {runs / 'ckpt' / name} at iteration 2" in log


@pytest.mark.parametrize("name", list(RESHARDED))
def test_loads_at_another_dp_or_ep(runs: Path, name: str) -> None:
    """Half the data-parallel ranks (the expert buckets' edp 2 -> 1); with the plain optimizer ep 1,
    or ep 4 (and dp 4)."""
    layout, world, _ = RESHARDED[name]
    whole, resumed = _last(runs, layout, LAYOUTS[layout][0]), _last(runs, name, world)
    assert len(resumed["losses"]) == 1
    for key in ("losses", "grad_norms"):
        assert resumed[key][0] == pytest.approx(whole[key][2], rel=TOL, abs=TOL), (name, key)
    for got, want in zip(resumed["moe"][0]["layers"], whole["moe"][2]["layers"], strict=True):
        assert got["tokens_per_expert"] == want["tokens_per_expert"], (name, got["layer"])  # exact
        assert got["load_balancing_loss"] == pytest.approx(want["load_balancing_loss"], rel=TOL, abs=TOL)


def test_each_ep_rank_writes_its_own_experts_and_expert_buckets(runs: Path) -> None:
    """ep 2 x dp 4: every expert of every layer once under its global name; each ep rank's expert
    buckets under its own keys, in two chunks (its edp ranks' shards); the dense ones in four."""
    meta = FileSystemReader(runs / "ckpt" / "ep2-dp4" / "iter_0000002").read_metadata().state_dict_metadata
    experts = {k.split(".")[5] for k in meta if k.startswith("model.layers.1.mlp.experts.")}
    assert experts == {"0", "1", "2", "3"}
    buckets = {e: sorted(k for k in meta if k.startswith(f"optimizer.distrib.pp0.ep{e}.")) for e in (0, 1)}
    assert buckets[0] and [k.replace("ep0", "ep1") for k in buckets[0]] == buckets[1]
    for key in buckets[0] + buckets[1]:
        assert len(meta[key].chunks) == 2, key  # edp 2
    dense = meta["optimizer.distrib.pp0.bucket0.param"]
    assert len(dense.chunks) == 4 and dense.size[0] == 1  # dp x cp 4, tp 1
    tp2 = FileSystemReader(runs / "ckpt" / "tp2-ep2" / "iter_0000002").read_metadata().state_dict_metadata
    assert tp2["model.layers.0.mlp.experts.3.fc1.weight"].size == (128, 32)  # both tp shards: the whole F x H


def test_the_distributed_optimizers_state_at_another_ep_is_refused(runs: Path, tmp_path: Path) -> None:
    data = prepare_data(runs / "data", vocab_size=512, max_files=40).argv()  # the fixture's
    argv = [*MODEL, *data, *DISTOPT.split(), "--load", str(runs / "ckpt" / "ep2-dp4")]
    with pytest.raises(Exception, match=(
        r"written with --expert-model-parallel-size 2 and this run has 1: .* load it with "
        r"--expert-model-parallel-size 2, or with --no-load-optim"
    )):  # fmt: skip
        spawn_pretrain(argv, 2, tmp_path / "run")


def test_both_formats_read_back_as_the_same_whole_model(runs: Path) -> None:
    """The Llama-MoE at pp 2 x ep 2 after 2 iterations, saved in torch_dist and in the legacy format
    (mp_rank_00_<pp>_<ep>: the reader tells the pp and ep ranks apart by the saved sizes)."""
    dist, legacy = (course_checkpoint.inspect(str(runs / "ckpt" / n)) for n in ("pp2-ep2", "pp2-ep2-torch"))
    assert (dist.ckpt_format, legacy.ckpt_format) == ("torch_dist", "torch")
    assert dist.arch.hf_class == "MixtralForCausalLM"
    assert sorted(legacy.files) == [(0, pp, ep) for pp in (0, 1) for ep in (0, 1)]
    want, got = (course_checkpoint.read_model(ckpt).state_dict() for ckpt in (dist, legacy))
    assert {k.split(".")[4] for k in want if ".experts." in k} == {"0", "1", "2", "3"}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
