"""Megatron-LM's own GPT-3 example launch script runs here with only sizes, paths and iteration
counts changed; the global batch ramps up as Megatron ramps it, and data parallelism follows.

``EXAMPLE`` keeps the groups and the flags of examples/gpt3/train_gpt3_175b_distributed.sh in
Megatron-LM (the 175B run: 96 layers, hidden 12288, global batch 1536, tp 8, pp 16), every
value that is a size, a path or a count made small.
"""

from __future__ import annotations

import shlex

import pytest
import torch

from distlab.gpt.training.log import ITERATION
from distlab.local_runs import prepare_data, spawn_pretrain

pytestmark = pytest.mark.timeout(240)

GPT_MODEL_ARGS = "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 "
GPT_MODEL_ARGS += "--max-position-embeddings 32 --attention-backend auto"
TRAINING_ARGS = (
    "--micro-batch-size 1 --global-batch-size 4 {ramp} --train-iters 4 --weight-decay 0.1 "
    "--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 "
    "--lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000"
)
MODEL_PARALLEL_ARGS = "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1"
DATA_ARGS = "--split 90,8,2"  # the example says 949,50,1: this corpus is too small for a 0.1% test split
EVAL_AND_LOGGING_ARGS = "--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 2"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=80).argv()


def example(ramp: str, data: list[str], root) -> list[str]:
    flags = " ".join([GPT_MODEL_ARGS, TRAINING_ARGS.format(ramp=ramp), MODEL_PARALLEL_ARGS, DATA_ARGS,
                      EVAL_AND_LOGGING_ARGS])  # fmt: skip
    paths = [
        "--save",
        str(root / "ckpt"),
        "--load",
        str(root / "ckpt"),
        "--tensorboard-dir",
        str(root / "tb"),
    ]
    return [*shlex.split(flags), *data, *paths]  # as bash splits the script's arrays


@pytest.mark.parametrize(
    "ramp",
    ["--rampup-batch-size 2 2 4", '--step-batch-size-schedule "0:2 128:4"'],  # 128 tokens = 4 samples
    ids=["rampup-batch-size", "step-batch-size-schedule"],
)
def test_megatron_gpt3_example_runs_with_small_sizes(ramp, data, tmp_path):
    run = spawn_pretrain(example(ramp, data, tmp_path), 1, tmp_path / "run")
    lines = ITERATION.parse(run.log)
    assert [r["gbs"] for r in lines] == [2, 2, 4, 4], run.log[-2000:]  # 2 until 4 samples, then 4
    assert [r["samples"] for r in lines] == [2, 4, 8, 12]
    assert "> batch-size ramp: global batch 2 from sample 0, 4 from sample 4" in run.log
    assert "precision: fp16 autocast" in run.log and "successfully saved checkpoint" in run.log


def test_a_ramp_over_data_parallel_ranks_equals_one_process(data, tmp_path):
    """Global batch 2, 4, 6, 8 (Megatron's ramp 2 2 12): over dp 2 each step takes its own number
    of micro-batches per rank, and the losses are those of one process taking them all."""
    base = [*GPT_MODEL_ARGS.split(), *data, "--lr", "3e-3", "--train-iters", "5", "--global-batch-size", "8",
            "--rampup-batch-size", "2", "2", "12", "--log-interval", "1", "--eval-iters", "0", "--seed", "5",
            "--attention-dropout", "0", "--hidden-dropout", "0"]  # fmt: skip
    dp2 = spawn_pretrain([*base, "--micro-batch-size", "1"], 2, tmp_path / "dp2")
    one = spawn_pretrain([*base, "--micro-batch-size", "2"], 1, tmp_path / "one")
    sizes = [r["gbs"] for r in ITERATION.parse(dp2.log)]
    assert sizes == [2, 2, 4, 6, 8] == [r["gbs"] for r in ITERATION.parse(one.log)]
    assert "micro batch 1 x data-parallel 2 x accumulation steps 4" in dp2.log  # at the final 8
    torch.testing.assert_close(
        torch.tensor(dp2.last["losses"]), torch.tensor(one.last["losses"]), rtol=1e-5, atol=1e-5
    )
