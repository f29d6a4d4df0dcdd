"""Mixture of experts composed with the other dimensions, through the whole driver.

A tiny MoE GPT (4 layers, hidden 32, 4 heads, sequence 16, 4 experts, top-2, aux loss coeff
1e-2, global batch 8 of micro-batches of 2) trains 3 iterations in fp32 with every layout below
and with one process; losses, gradient norms, the validation loss and the [moe] statistics
(tokens per expert of every layer, summed over the ranks; the load-balancing loss) must match::

    ep 2 (dp 2), allgather (Megatron's default) and alltoall token dispatchers
    tp 2 (sequence parallel) x ep 2 (dp 2), alltoall: each pair sent to both etp shards
    tp 2 (sequence parallel) x pp 2 x ep 2 (dp 2), allgather: 8 ranks, the aux losses of both stages
    cp 2 x ep 2 (dp 2), allgather: an ep group is the two cp ranks of one sample
    interleaved pp 2 (v 2) x ep 2 (dp 2), allgather: layers 0, 2 on stage 0 and 1, 3 on stage 1
    Llama-MoE (RMSNorm, RoPE, SwiGLU experts without biases, 2 query groups, untied output) on
    tp 2 (sequence parallel) x pp 2 x ep 2 (dp 2) and on tp 2 (sequence parallel) x cp 2 x ep 2
    (each rank routes T / (cp tp) tokens of a sample), against the same Llama-MoE on one process

and an ep 2 checkpoint in the legacy format (one file per ep rank) resumes the ep 2 run exactly.

One spawn of 8 gloo ranks runs them all (the reference on rank 0 alone).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distlab.local_ranks import free_port, spawn_ranks
from distlab.local_runs import prepare_data
from tests.conftest import assert_same_training, train_plan

pytestmark = pytest.mark.timeout(600)

RTOL = 1e-6  # rtol = atol: fp32 sums in another order, as tests/test_gpt_parallel_equivalence.py
MODEL = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 "
    "--make-vocab-size-divisible-by 128 --seed 1234 --split 949,50,1 --log-interval 1 "
    "--eval-interval 3 --eval-iters 1 --distributed-backend gloo "
    "--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2"
    " --attention-dropout 0 --hidden-dropout 0"
).split()
LLAMA = (
    "--normalization RMSNorm --position-embedding-type rope --swiglu --group-query-attention "
    "--num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights"
)
#: name: (world, extra flags); the references run on rank 0 alone.
RUNS = {
    "reference": (1, ""),
    "llama-reference": (1, LLAMA),
    "llama-tp2-pp2-ep2": (
        8,
        f"{LLAMA} --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
        "--expert-model-parallel-size 2",
    ),
    "ep2-allgather": (2, "--expert-model-parallel-size 2 --moe-grouped-gemm"),
    "ep2-alltoall": (2, "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"),
    "tp2-ep2-alltoall": (
        4,
        "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
        "--moe-token-dispatcher-type alltoall",
    ),
    "tp2-pp2-ep2": (
        8,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel "
        "--expert-model-parallel-size 2",
    ),
    "cp2-ep2": (4, "--context-parallel-size 2 --expert-model-parallel-size 2"),
    "llama-tp2-cp2-ep2": (
        4,
        f"{LLAMA} --tensor-model-parallel-size 2 --context-parallel-size 2 --sequence-parallel "
        "--expert-model-parallel-size 2",
    ),
    "pp2-vp2-ep2": (
        4,
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --expert-model-parallel-size 2",
    ),
    # a checkpoint of experts split over ep ranks in the legacy format (torch_dist's:
    # test_gpt_dist_checkpoint_experts.py): 2 iterations saved, then the third resumed from it (the LR
    # schedule of 3 iterations in both)
    "ep2-save": (
        2,
        "--expert-model-parallel-size 2 --train-iters 2 --lr-decay-iters 3 --save {ckpt} --ckpt-format torch",
    ),
    "ep2-resume": (2, "--expert-model-parallel-size 2 --lr-decay-iters 3 --load {ckpt}"),
}
RESUMED = ("ep2-save", "ep2-resume")
REFERENCES = ("reference", "llama-reference")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("gpt_moe")
    data = prepare_data(base / "data", vocab_size=512, max_files=40).argv()
    ckpt = str(base / "ckpt")
    plan = [
        (name, world, [*MODEL, *data, *extra.format(ckpt=ckpt).split()], free_port())
        for name, (world, extra) in RUNS.items()
    ]
    spawn_ranks(train_plan, (plan, str(base)), max(world for world, _ in RUNS.values()))
    return base


def _history(folder: Path, name: str, rank: int) -> dict:
    return json.loads((folder / f"{name}.rank{rank}.json").read_text())


@pytest.mark.parametrize("name", [name for name in RUNS if name not in (*REFERENCES, *RESUMED)])
def test_moe_layout_matches_single_process(runs: Path, name: str) -> None:
    world = RUNS[name][0]
    reference = "llama-reference" if name.startswith("llama") else "reference"
    ref, last = _history(runs, reference, 0), _history(runs, name, world - 1)
    assert len(ref["losses"]) == 3 and ref["losses"][-1] < ref["losses"][0]  # it learns: not vacuous
    assert_same_training(last, ref, name, tol=RTOL)
    for got, want in zip(last["moe"], ref["moe"], strict=True):  # every iteration, every layer
        assert [s["layer"] for s in got["layers"]] == [0, 1, 2, 3], name
        for g, w in zip(got["layers"], want["layers"], strict=True):
            assert g["tokens_per_expert"] == w["tokens_per_expert"], f"{name}: layer {g['layer']}"
            assert sum(g["tokens_per_expert"]) == 2 * 8 * 16  # top-2 of the global batch's 8 x 16 tokens
            assert g["load_balancing_loss"] == pytest.approx(w["load_balancing_loss"], rel=RTOL, abs=RTOL)
    first = (runs / f"{name}.rank0.log").read_text()
    dispatcher = "alltoall" if "alltoall" in name else "allgather"
    assert f"{dispatcher} token dispatcher" in first and "a loop over the local experts" in first
    if "grouped-gemm" in RUNS[name][1]:
        assert "--moe-grouped-gemm: no grouped GEMM here" in first


def test_expert_parallel_checkpoint_resumes_the_same_run(runs: Path) -> None:
    """ep 2 with --save: one file per ep rank, Megatron's names (mp_rank_<tp>_<ep>); resumed with
    --load, the third iteration equals the uninterrupted ep 2 run's (losses, norm, [moe] counts)."""
    folder = runs / "ckpt" / "iter_0000002"
    assert sorted(p.name for p in folder.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    whole, resumed = _history(runs, "ep2-allgather", 1), _history(runs, "ep2-resume", 1)
    assert len(resumed["losses"]) == 1  # iteration 3 only
    for key in ("losses", "grad_norms"):
        assert resumed[key][0] == pytest.approx(whole[key][2], rel=RTOL, abs=RTOL), key
    assert resumed["moe"][0]["layers"] == whole["moe"][2]["layers"]
