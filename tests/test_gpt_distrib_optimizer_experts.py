"""--use-distributed-optimizer with expert parallelism, through the whole driver.

A tiny MoE GPT (2 layers, hidden 32, 4 heads, sequence 16, 4 experts, top-2, aux loss, global
batch 8 of micro-batches of 2) trains 3 iterations in fp32 on 4 gloo ranks with ep 2 (dp 4: each
expert-data-parallel group holds 2 ranks) and the distributed optimizer, with small buckets (several
dense and several expert buckets): the dense buckets reduce-scattered over dp 4, the experts' over
their edp group of 2, both scaled by 1 / 4 (Megatron's). Without and with --overlap-grad-reduce
--overlap-param-gather its losses, gradient norms (every expert counted once) and validation loss
equal one process's (the plain optimizer) within 1e-5. A --ckpt-format torch checkpoint (one file
per ep rank, each with the dense buckets whole and its own experts' buckets whole) resumes the
third iteration exactly, and with 2 ranks (ep 2, dp 2: edp 1) within 1e-5. Each rank's optimizer
state is what the memory estimator predicts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distlab.gpt.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import estimate
from distlab.gpt.memory.meters import MEMORY, MiB
from distlab.gpt.memory.setup import MemorySetup
from distlab.gpt.optimizer.distrib_optimizer import build_distributed_optimizer
from distlab.gpt.optimizer.optimizer_config import OptimizerConfig
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.gpt.transformer.moe.moe_layer import MoEConfig
from distlab.local_ranks import free_port, spawn_ranks
from distlab.local_runs import prepare_data
from tests.conftest import assert_same_training, run_gloo, train_plan

pytestmark = pytest.mark.timeout(400)

TOL = 1e-5  # fp32 sums in another order (reduce-scatters of pre-scaled buckets, shards' norms)
MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 "
    "--make-vocab-size-divisible-by 128 --seed 1234 --split 949,50,1 --log-interval 1 "
    "--eval-interval 3 --eval-iters 1 --distributed-backend gloo "
    "--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2"
    " --attention-dropout 0 --hidden-dropout 0"
).split()
EP = "--expert-model-parallel-size 2 --use-distributed-optimizer --ddp-bucket-size 3000"
OVERLAP = f"{EP} --overlap-grad-reduce --overlap-param-gather"
#: name: (world, extra flags); the reference runs on rank 0 alone, with the plain optimizer.
RUNS = {
    "reference": (1, ""),
    "ep2": (4, EP),
    "ep2-overlap": (4, OVERLAP),
    # 2 iterations saved, then the third resumed (the LR schedule of 3 iterations in all)
    "ep2-save": (4, f"{OVERLAP} --train-iters 2 --lr-decay-iters 3 --save {{ckpt}} --ckpt-format torch"),
    "ep2-resume": (4, f"{OVERLAP} --lr-decay-iters 3 --load {{ckpt}}"),
    "ep2-resume-world2": (2, f"{OVERLAP} --lr-decay-iters 3 --load {{ckpt}}"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("distopt_ep")
    data = prepare_data(base / "data", vocab_size=512, max_files=40).argv()
    ckpt = str(base / "ckpt")
    plan = [
        (name, world, [*MODEL, *data, *extra.format(ckpt=ckpt).split()], free_port())
        for name, (world, extra) in RUNS.items()
    ]
    spawn_ranks(train_plan, (plan, str(base)), 4)
    return base


def _history(folder: Path, name: str, rank: int) -> dict:
    return json.loads((folder / f"{name}.rank{rank}.json").read_text())


@pytest.mark.parametrize("name", ["ep2", "ep2-overlap"])
def test_expert_parallel_distributed_optimizer_equals_one_process(runs: Path, name: str) -> None:
    ref, last = _history(runs, "reference", 0), _history(runs, name, 3)
    assert len(ref["losses"]) == 3 and ref["losses"][-1] < ref["losses"][0]  # it learns: not vacuous
    assert_same_training(last, ref, name, tol=TOL)
    log = (runs / f"{name}.rank0.log").read_text()
    assert "sharded over dp x cp = 4 ranks" in log
    assert "expert parameters over their expert-data-parallel group of d = 2 rank(s)" in log
    assert "12 bytes per parameter per rank" in log  # fp32 experts: 8 + 8/2


def test_each_ranks_optimizer_state_is_the_estimators(runs: Path) -> None:
    """fp32 moments, 8 bytes per value: the dense ones over 4 ranks, the experts' over 2 (Megatron's
    8 + 8/d with each kind's d), as ``memory_estimate`` predicts (8 x 59,328 / 4 bytes if it did not)."""
    setup = MemorySetup(num_layers=2, hidden_size=32, seq_length=16, num_attention_heads=4, vocab_size=512,
                        micro_batch_size=2, precision="fp32", dp=4, ep=2, num_experts=4,
                        distributed_optimizer=True)  # fmt: skip
    predicted = estimate(setup).optimizer_state
    lines = MEMORY.parse((runs / "ep2.rank0.log").read_text())
    assert len(lines) == 4 and predicted > 8 * lines[0]["values"] / 4 * 1.5
    for line in lines:
        assert line["optim_mib"] == pytest.approx(predicted / MiB, abs=0.01)


def test_checkpoint_has_the_dense_and_each_ep_ranks_expert_buckets(runs: Path) -> None:
    """One file per ep rank; each holds every bucket whole: the dense ones alike, the experts' its own."""
    folder = runs / "ckpt" / "iter_0000002"
    assert sorted(p.name for p in folder.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    files = [
        torch.load(folder / f"mp_rank_00_00{e}" / "model_optim_rng.pt", weights_only=False) for e in (0, 1)
    ]
    saved = [f["optimizer"]["distributed_optimizer"]["buckets"] for f in files]
    assert (
        len(saved[0]) == len(saved[1]) > 2
        and int(files[0]["optimizer"]["distributed_optimizer"]["step"]) == 2
    )
    same = [
        all(torch.equal(a[k], b[k]) for k in ("param", "exp_avg", "exp_avg_sq"))
        for a, b in zip(*saved, strict=True)
    ]
    assert same[0] and not same[-1], same  # the first bucket is dense, the last one the experts'
    n_dense = same.index(False)
    assert all(same[:n_dense]) and not any(same[n_dense:]), same
    for buckets in saved:
        assert all(b["param"].numel() == b["exp_avg"].numel() == b["numel"] for b in buckets)
        assert all(b["exp_avg_sq"].abs().sum() > 0 for b in buckets)  # every shard's moments gathered
    experts = [{k for k in f["model"] if ".experts." in k} for f in files]  # global expert numbers
    assert experts[0] and experts[1] and not experts[0] & experts[1]  # each ep rank its own experts


def test_resume_exactly_and_on_two_ranks(runs: Path) -> None:
    """Resumed at iteration 2 with 4 ranks: the uninterrupted run's third iteration to the bit; with 2
    ranks (each rank now holds all of its experts' shards, edp 1) within 1e-5."""
    whole = _history(runs, "ep2-overlap", 3)
    same, half = _history(runs, "ep2-resume", 3), _history(runs, "ep2-resume-world2", 1)
    assert len(same["losses"]) == 1 and len(half["losses"]) == 1  # iteration 3 only
    for key in ("losses", "grad_norms"):
        assert same[key][0] == whole[key][2], key
        assert half[key][0] == pytest.approx(whole[key][2], rel=TOL, abs=TOL), key


def _every_bucket_waited_rank(ctx) -> None:
    """An untied MoE GPT in buckets of about one matrix each, dp 2: after the step's all-gathers
    start, one forward waits for every bucket in its modules' pre-hooks (an expert's fc1 and fc2,
    read by the expert's own forward, and the output layer, read by the model's, included)."""
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16,
                    untie_embeddings_and_output_weights=True, moe=MoEConfig(num_experts=4))  # fmt: skip
    model = GPTModel(cfg, ParallelState.build(Layout(2)))
    optim = OptimizerConfig(lr=1e-3, weight_decay=0.0, adam_beta2=0.95)
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=1000)
    buffer = build_distributed_optimizer(model, model.state, optim, ddp, torch.float32).buffer
    experts = {i for i, b in enumerate(buffer.buckets) if all(".experts." in n for n, p in model.named_parameters()
                                                              if any(p is q for q in b.params))}  # fmt: skip
    assert len(buffer.buckets) > 10 and experts, len(buffer.buckets)  # buckets of experts' weights alone
    buffer.start_param_sync()
    assert len(buffer.pending) == len(buffer.buckets)
    model(torch.randint(0, 128, (2, 16)))
    assert not buffer.pending, sorted(buffer.pending)


def test_one_forward_waits_for_every_bucket() -> None:
    run_gloo(_every_bucket_waited_rank, 2)
