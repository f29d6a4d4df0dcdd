"""A dry run (one rank on the meta device, fake process group) against a real run of the same layout.

Eight gloo ranks build the tiny GPT for real at tp 2 x pp 2 x dp 2 with sequence parallelism and
record the collectives of one step's forward/backward, gradient reduction and norm; the dry run of
every rank of the same layout must find the same parameters and the same collectives (operation,
group, size, bytes, count). The 70B-shaped dry run of the issue runs from the command line in a
subprocess and must finish within its budget.
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
from tests.conftest import TINY_GPT_ARGV, run_gloo

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel".split()
DATA = "--mock-data --tokenizer-type NullTokenizer --vocab-size 200".split()
ARGV = [*TINY_GPT_ARGV, *DATA, *LAYOUT]


def _as_rows(calls) -> list:
    return sorted([c.op, c.group, c.size, c.nbytes, n] for c, n in Counter(calls).items())


def _real_rank(ctx, out: str) -> None:
    args = parse_args(ARGV)
    layout = validate_args(args, ctx.world_size)
    state = ParallelState.build(layout)
    model = build_model(args, state, 256, torch.device("cpu"))  # 200 padded to 128 x tp
    calls = step_collectives(args, state, model, meta_batches(layout, args.seq_length, torch.device("cpu")))
    found = {"parameters": sum(p.numel() for p in model.parameters()), "calls": _as_rows(calls)}
    Path(out, f"{ctx.rank}.json").write_text(json.dumps(found))


def test_dry_runs_find_the_parameters_and_collectives_of_a_real_run(tmp_path: Path) -> None:
    run_gloo(_real_rank, 8, str(tmp_path))
    args = parse_args(ARGV)
    layout = validate_args(args, 8)
    total = 0
    for rank in range(8):
        real = json.loads(Path(tmp_path, f"{rank}.json").read_text())
        dry = dry_run(args, layout, rank)
        assert dry.parameters == real["parameters"], rank
        assert _as_rows(dry.collectives) == real["calls"], rank
        total += dry.parameters
    assert {r[1] for r in real["calls"]} >= {"tp", "pp", "dp"}  # every group of the layout was seen
    assert total > 0


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
    "--pipeline-model-parallel-size 8 --sequence-parallel --bf16 --dry-run-world-size 1024"
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
    assert ("embedding" in out.stdout) and (" tp " in out.stdout or "tp  " in out.stdout)
