"""Whole runs of a tiny Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases, untied
output layer) on every layout train the model of one process: losses, gradient norms and
validation losses within 1e-5 in fp32 (the layouts sum the same products in other orders).

tp 2 splits the 2 query groups' K/V heads; with 1 group (multi-query) tp 2 replicates them (its
own reference: another model). pp 2 puts the untied output layer on the last stage alone; cp 2
rotates each rank's two chunks by their global positions; SP all-gathers the sequence before
attention; tp 2 x cp 2 with SP (Megatron's Llama 3 script's flags: each rank's norms hold T / (cp tp)
tokens, attention the cp rank's T / cp); tp 2 with SP x interleaved pp 2 (v = 2: every chunk sends
its T / tp slice); then tp 2 x cp 2 x dp 2 with SP and cp 2 x interleaved pp 2 (v = 2) x dp 2 on 8
ranks (tp x cp without SP: ``test_gpt_context_parallel.py``).
One spawn of 8 gloo processes runs the plan in order (each run on its first ``world`` ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distlab.local_ranks import free_port, spawn_ranks
from distlab.local_runs import prepare_data, pretrain_as_rank
from tests.conftest import TINY_GPT_ARGV as MODEL
from tests.conftest import assert_same_training

pytestmark = pytest.mark.timeout(900)

TOL = 1e-5
LLAMA = (
    "--normalization RMSNorm --position-embedding-type rope --swiglu --group-query-attention "
    "--num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights"
).split()
#: name: (world, reference, flags on top of MODEL + LLAMA)
RUNS = {
    "reference": (1, None, []),
    "reference-mqa": (1, None, ["--num-query-groups", "1"]),
    "tp2": (2, "reference", ["--tensor-model-parallel-size", "2"]),
    "tp2-mqa": (2, "reference-mqa", ["--tensor-model-parallel-size", "2", "--num-query-groups", "1"]),
    "pp2": (2, "reference", ["--pipeline-model-parallel-size", "2"]),
    "cp2": (2, "reference", ["--context-parallel-size", "2"]),
    "tp2-sp": (2, "reference", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2-cp2-sp": (4, "reference", ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                                    "--sequence-parallel"]),
    "tp2-cp2-dp2-sp": (8, "reference", ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                                        "--sequence-parallel"]),
    "tp2-sp-ipp2": (4, "reference", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--pipeline-model-parallel-size", "2",
                                     "--num-layers-per-virtual-pipeline-stage", "1"]),
    "cp2-ipp2-dp2": (8, "reference", ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                      "--num-layers-per-virtual-pipeline-stage", "1"]),
}  # fmt: skip


def _worker(rank: int, plan: list, out: str) -> None:
    torch.set_num_threads(1)
    for name, world, argv, port in plan:
        if rank < world:
            log = Path(out, f"{name}.rank{rank}.log")
            history = pretrain_as_rank(rank, world, port, argv, log)
            history["log"] = log.read_text()
            Path(out, f"{name}.rank{rank}.json").write_text(json.dumps(history))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("gpt_llama")
    data = prepare_data(base / "data", vocab_size=512, max_files=40).argv()
    plan = [
        (name, world, [*MODEL, *data, *LLAMA, *flags], free_port())
        for name, (world, _, flags) in RUNS.items()
    ]
    spawn_ranks(_worker, (plan, str(base)), 8)
    return base


def _history(folder: Path, name: str, rank: int) -> dict:
    return json.loads((folder / f"{name}.rank{rank}.json").read_text())


@pytest.mark.parametrize("name", [name for name, (_, ref, _) in RUNS.items() if ref])
def test_llama_layout_matches_single_process(runs: Path, name: str) -> None:
    world, reference, _ = RUNS[name]
    ref, last = _history(runs, reference, 0), _history(runs, name, world - 1)
    assert len(ref["losses"]) == 3 and ref["losses"][-1] < ref["losses"][0]  # it learns: not vacuous
    assert_same_training(last, ref, name, tol=TOL)
    first = _history(runs, name, 0)["log"]
    assert f"using world size: {world}," in first
    if "cp2" in name:
        assert "> context parallelism: 2 ranks, sequence 16 in 4 chunks" in first
    if "ipp2" in name:
        assert "> pipeline schedule interleaved 1f1b: 2 stages x 2 chunks" in first


def test_the_two_references_are_different_models(runs: Path) -> None:
    """1 K/V group is another model than 2: the mqa comparison is not the gqa one again."""
    gqa, mqa = _history(runs, "reference", 0), _history(runs, "reference-mqa", 0)
    assert gqa["losses"][0] != mqa["losses"][0]
    assert "number of parameters on (tensor, pipeline) model parallel rank (0, 0): 69920" in gqa["log"]
