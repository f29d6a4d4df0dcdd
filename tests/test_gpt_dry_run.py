"""A dry run (one rank on the meta device, fake process group) against a real run of the same layout.

Gloo ranks build the tiny GPT for real (tp 2 x pp 2 x dp 2 with sequence parallelism; cp 2 x
pp 2; pp 2 x v 2 x dp 2; tp 2 x dp 2 with the distributed optimizer; experts over ep 2 of dp 4)
and record the collectives of one training step (LocalBackend: forward/backward, the gradients'
reduction, norm and step); the dry run of every rank of the same layout must find the same
parameters and the same collectives (operation, group, size, bytes, count). The 70B-shaped dry
run of the issue runs from the command line in a subprocess and must finish within its budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from distlab.gpt.arguments import ArgumentError, parse_args, validate_args
from distlab.gpt.build import build_model
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.planning.dry_run import dry_run, meta_batches, model_states, step_collectives
from distlab.gpt.pretrain import pretrain
from distlab.gpt.tensor_parallel.layers import pad_vocab_size
from tests.conftest import TINY_GPT_ARGV, run_gloo

ROOT = Path(__file__).resolve().parents[1]
DATA = "--mock-data --tokenizer-type NullTokenizer --vocab-size 200".split()
ARGV = [
    *TINY_GPT_ARGV,
    *DATA,
    *"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel".split(),
]
#: (world, flags): tp x pp x dp with SP; cp x pp; the interleaved pipeline; experts over ep 2 of dp 4
LAYOUTS = {
    "tp2-pp2-dp2-sp": (8, ARGV),
    "cp2-pp2": (
        4,
        [*TINY_GPT_ARGV, *DATA, *"--context-parallel-size 2 --pipeline-model-parallel-size 2".split()],
    ),
    "pp2-v2-dp2": (
        4,
        [
            *TINY_GPT_ARGV,
            *DATA,
            *"--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2".split(),
        ],
    ),
    "tp2-dp2-distopt": (
        4,
        [*TINY_GPT_ARGV, *DATA, *"--tensor-model-parallel-size 2 --use-distributed-optimizer".split()],
    ),
    "dp4-ep2": (
        4,
        [
            *TINY_GPT_ARGV,
            *DATA,
            *"--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall".split(),
        ],
    ),
}


def _as_rows(calls) -> list:
    return sorted([c.op, c.group, c.size, c.nbytes, n] for c, n in Counter(calls).items())


def _real_rank(ctx, out: str, argv: list[str]) -> None:
    args = parse_args(argv)
    layout = validate_args(args, ctx.world_size)
    state = ParallelState.build(layout)
    vocab = pad_vocab_size(200, args.make_vocab_size_divisible_by, layout.tp)
    model = build_model(args, state, vocab, torch.device("cpu"))
    calls = step_collectives(args, state, model, meta_batches(layout, args.seq_length, torch.device("cpu")))
    found = {"parameters": sum(p.numel() for p in model.parameters()), "calls": _as_rows(calls)}
    Path(out, f"{ctx.rank}.json").write_text(json.dumps(found))


@pytest.mark.parametrize("name", LAYOUTS)
def test_dry_runs_find_the_parameters_and_collectives_of_a_real_run(tmp_path: Path, name: str) -> None:
    world, argv = LAYOUTS[name]
    run_gloo(_real_rank, world, str(tmp_path), argv)
    args = parse_args(argv)
    layout = validate_args(args, world)
    for rank in range(world):
        real = json.loads(Path(tmp_path, f"{rank}.json").read_text())
        dry = dry_run(args, layout, rank)
        assert dry.parameters == real["parameters"], rank
        if name == "dp4-ep2":  # experts: parameters only (routing needs the data's values)
            assert dry.collectives is None and "not recorded with --num-experts" in dry.report()[-1]
            continue
        assert _as_rows(dry.collectives) == real["calls"], rank
    groups = {
        "tp2-pp2-dp2-sp": {"tp", "pp", "dp"},
        "cp2-pp2": {"cp", "pp"},
        "pp2-v2-dp2": {"pp", "dp"},
        "dp4-ep2": {"ep", "dp"},
        "tp2-dp2-distopt": {"tp", "dp"},
    }
    assert {r[1] for r in real["calls"]} >= groups[name]  # every group of the layout was seen


def test_model_states_follow_megatrons_table() -> None:
    n, d = 1000, 8
    assert sum(model_states(n, "bf16", d, False)) == 18 * n
    assert sum(model_states(n, "bf16", d, True)) == pytest.approx((6 + 12 / d) * n)
    assert sum(model_states(n, "fp32", d, False)) == 16 * n
    assert sum(model_states(n, "fp32", d, True)) == pytest.approx((8 + 8 / d) * n)
    assert sum(model_states(n, "fp16", d, True)) == pytest.approx((4 + 16 / d) * n)


def test_a_rank_outside_the_world_is_refused_before_compute() -> None:
    with pytest.raises(ArgumentError, match="--dry-run-rank 8 is not a rank of --dry-run-world-size 8"):
        pretrain([*ARGV, "--dry-run-world-size", "8", "--dry-run-rank", "8"])


LLAMA_70B = (
    "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --seq-length 8192 "
    "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 128 --train-iters 10 --lr 1e-4 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --tensor-model-parallel-size 8 "
    "--pipeline-model-parallel-size 8 --sequence-parallel --bf16 --use-distributed-optimizer --dry-run-world-size 1024 "
    "--swiglu --group-query-attention --num-query-groups 8 --normalization RMSNorm --position-embedding-type rope "
    "--untie-embeddings-and-output-weights --disable-bias-linear"
).split()


@pytest.mark.parametrize("rank", [0, 1023])
def test_a_70b_shaped_dry_run_of_1024_ranks_ends_within_60_s(rank: int) -> None:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, str(ROOT / "code" / "pretrain_gpt.py"), *LLAMA_70B, "--dry-run-rank", str(rank)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"{elapsed:.1f} s"
    assert f"> dry run: rank {rank} of 1024" in out.stdout
    assert "with distributed optimizer" in out.stdout and "GiB" in out.stdout
    assert "embedding" not in out.stdout  # untied: no embedding group
    assert "reduce_scatter" in out.stdout and "all_gather" in out.stdout  # SP and the distributed optimizer


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_state_bytes_are_the_distributed_optimizers_own(precision: str, dtype: torch.dtype) -> None:
    from distlab.gpt.optimizer.distrib_optimizer import bytes_per_parameter

    for d in (1, 2, 16):
        assert sum(model_states(1, precision, d, True)) == pytest.approx(bytes_per_parameter(dtype, d))
