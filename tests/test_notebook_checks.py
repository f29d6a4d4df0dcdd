"""Every check cell of notebooks 00-03: right answers pass, wrong ones fail, untouched ones wait.

Each case names a notebook, the answer variables of one check cell with their right values (those
of the solution notebook), one wrong answer, and what else the cell reads. The check cell's own
source, taken from the committed notebook, runs three times: right (prints ``[ok]``), wrong
(raises ExerciseError) and untouched (every answer ``FIXME``: prints ``[not yet]``, raises nothing).
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch
from torch.utils.data import DistributedSampler

from distlab import REPO_ROOT, topology
from distlab.checks import FIXME, ExerciseError, check, script_untouched
from distlab.comm import collectives
from distlab.gpt.build import PARAMETERS
from distlab.gpt.pretrain import MOE
from distlab.gpt.training.log import ITERATION
from distlab.logs import experts, nccl

WORLD = 4  # the local cluster's two-node jobs: 2 nodes x 2 processes
CHUNKS = [len(c) for c in torch.tensor_split(torch.arange(1001), WORLD)]
ROW = {
    "bytes": "4194304",
    "time_us": "2000.0",
    "world_size": "2",
    "busbw_GBps": str(4194304 / 2e-3 / 1e9 / 2),
}


def nvlink_pairs(matrix):
    return [{"GPU0", "GPU1"}, {"GPU2", "GPU3"}]


CASES = [  # (notebook, right answers, one wrong answer, context)
    ("00_start_here", {"address_field": "NodeAddr"}, {"address_field": "NodeHostName"}, {}),
    ("00_start_here", {"ranks_on_second_node": [2, 3]}, {"ranks_on_second_node": [1, 3]}, {}),
    ("00_start_here", {"time_limit_given": "00:01:00"}, {"time_limit_given": "00:00:01"}, {}),
    ("01_system_topology", {"numa_nodes": 2}, {"numa_nodes": 1}, {"here": {"cpu": {"NUMA node(s)": "2"}}}),
    ("01_system_topology", {"nvlink_groups": nvlink_pairs}, {"nvlink_groups": lambda m: [set(m)]}, {}),
    (
        "01_system_topology",
        {"nccl_gpu0_gpu1": "P2P/CUMEM", "nccl_between_nodes": "NET/IB"},
        {"nccl_gpu0_gpu1": "P2P/NVL"},
        {},
    ),
    (  # as NCCL prints them (distlab.logs.nccl's docstring)
        "01_system_topology",
        {"nccl_gpu0_gpu1": "P2P/IPC/read", "nccl_between_nodes": "NET/IB/0/GDRDMA"},
        {"nccl_between_nodes": "NET/Socket/0"},
        {},
    ),
    (
        "01_system_topology",
        {"nccl_gpu0_gpu1": "P2P/CUMEM/read", "nccl_between_nodes": "NET/IBext_v8/1/GDRDMA"},
        {"nccl_gpu0_gpu1": "SHM/direct/direct"},
        {},
    ),
    (
        "02_collectives",
        {"launcher_under_plain_srun": "srun", "rank_variable": "SLURM_PROCID"},
        {"rank_variable": "RANK"},
        {},
    ),
    ("02_collectives", {"chain_breaker": 1}, {"chain_breaker": 0}, {}),
    (
        "02_collectives",
        {
            "rank2_reduce_scatter": [616, 620],
            "rank1_all_to_all": [1, 11, 21, 31],
            "odd_group_min": [11, 12],
            "sum_everywhere": "all_reduce",
            "shard_of_sum": "reduce_scatter",
        },
        {"rank2_reduce_scatter": [4, 5]},
        {"WORLD": WORLD},
    ),
    ("02_collectives", {"rank0_sends": 1502}, {"rank0_sends": 1501.5}, {"WORLD": WORLD, "chunks": CHUNKS}),
    (
        "02_collectives",
        {"my_busbw": float(ROW["busbw_GBps"]), "allreduce_1GB_ms": 11.67},
        {"allreduce_1GB_ms": 6.67},
        {"row": ROW},
    ),
    (
        "03_cifar_ddp",
        {"training_checksums_attribute": "train_list"},
        {"training_checksums_attribute": "md5"},
        {},
    ),
    ("03_cifar_ddp", {"indices_per_rank": 4, "images_seen_twice": None}, {"indices_per_rank": 3}, {}),
    ("03_cifar_ddp", {"indices_per_rank": 4, "images_seen_twice": None}, {"images_seen_twice": [0, 1]}, {}),
    ("03_cifar_ddp", {"indices_per_rank": 4, "images_seen_twice": None}, {"images_seen_twice": 2}, {}),
    (
        "03_cifar_ddp",
        {
            "rank_variable": {
                "srun+torchrun": "RANK",
                "mpirun": "OMPI_COMM_WORLD_RANK",
                "srun": "SLURM_PROCID",
            }
        },
        {
            "rank_variable": {
                "srun+torchrun": "SLURM_PROCID",
                "mpirun": "OMPI_COMM_WORLD_RANK",
                "srun": "SLURM_PROCID",
            }
        },
        {},
    ),
    (
        "03_cifar_ddp",
        {
            "steps_per_epoch": {"1 process": 47, "DDP, 1 node": 24, "DDP, 2 nodes": 12},
            "predicted_efficiency": 0.83,
        },
        {"steps_per_epoch": {"1 process": 47, "DDP, 1 node": 47, "DDP, 2 nodes": 47}},
        {"NUM_TRAIN": 3000, "BATCH": 64, "PROCS": 2, "WORLD": WORLD},
    ),
    ("03_cifar_ddp", {"resumed_equals_uninterrupted": True}, {"resumed_equals_uninterrupted": False}, {}),
]


def check_cell(notebook: str, names: list[str]) -> str:
    """The source of the code cell that calls check() on all of ``names``."""
    cells = json.loads((REPO_ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    for cell in cells:
        text = "".join(cell["source"])
        if cell["cell_type"] == "code" and "check(" in text and "= FIXME" not in text:
            if all(name in text for name in names):
                return text
    raise AssertionError(f"{notebook}: no check cell uses {names}")


def run_cell(source: str, answers: dict, context: dict) -> str:
    namespace = {
        "check": check,
        "FIXME": FIXME,
        "script_untouched": script_untouched,
        "collectives": collectives,
        "math": math,
        "topology": topology,
        "nccl": nccl,
        "DistributedSampler": DistributedSampler,
        "BACKEND": "gloo",
        **context,
        **answers,
    }
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<check cell>", "exec"), namespace)
    return out.getvalue()


@pytest.fixture
def untouched_scripts(tmp_path, monkeypatch):
    """The exercises' batch scripts as the notebooks leave them: still FIXME."""
    (tmp_path / "jobs").mkdir()
    for name in ("ranks.sbatch", "cifar-part1.sbatch", "cifar-part2.sbatch"):
        (tmp_path / "jobs" / name).write_text("#!/bin/bash\nFIXME\n")
    monkeypatch.chdir(tmp_path)


def right_answers(answers: dict) -> dict:
    """Fill answers that depend on the sampler's shuffle with what it really gives."""
    if answers.get("images_seen_twice", 0) is None:
        shards = [list(DistributedSampler(range(10), num_replicas=3, rank=r)) for r in range(3)]
        flat = [i for s in shards for i in s]
        answers = {**answers, "images_seen_twice": sorted({i for i in flat if flat.count(i) > 1})}
    return answers


@pytest.mark.parametrize("notebook,answers,wrong,context", CASES, ids=lambda v: str(v)[:40])
def test_check_cell(notebook, answers, wrong, context, untouched_scripts):
    source = check_cell(notebook, list(answers))
    right = right_answers(answers)
    assert "[ok]" in run_cell(source, right, context)
    with pytest.raises(ExerciseError):
        run_cell(source, {**right, **wrong}, context)
    placeholders = {n: (lambda *a: FIXME) if callable(v) else FIXME for n, v in answers.items()}
    untouched = run_cell(source, placeholders, context)
    assert "[not yet]" in untouched and "[ok]" not in untouched


def test_all_gather_exercise_check(untouched_scripts):
    source = check_cell("02_collectives", ["my_all_gather", "results"])
    lines = [f"[rank {r}/4 node] my_all_gather shape {s}: ok" for r in range(WORLD) for s in range(3)]
    assert "[ok]" in run_cell(source, {"results": lines}, {"WORLD": WORLD})
    with pytest.raises(ExerciseError):
        run_cell(source, {"results": [*lines[:-1], lines[-1].replace("ok", "WRONG")]}, {"WORLD": WORLD})
    waiting = ["[rank 0/4 node] my_all_gather: not implemented yet (TODO)"]
    assert "[not yet]" in run_cell(source, {"results": waiting}, {"WORLD": WORLD})


def budget_log(num_experts: int, parameters: int, last: int, total: int = 5) -> str:
    """A MoE run's log as the driver prints it: the parameter line, then per iteration its line and
    one ``[moe]`` line per layer (2 layers, the 16 x 4 x 64 x 2 pairs shared out evenly)."""
    lines = [PARAMETERS.format(tp_rank=0, pp_rank=0, parameters=parameters)]
    for it in range(1, last + 1):
        lines.append(
            ITERATION.format(
                it=it,
                total=total,
                samples=16 * it,
                ms=150.0,
                lr=1e-3,
                gbs=16,
                loss=8.0,
                scale=1.0,
                skipped=0,
                nan=0,
            )
        )
        counts = " ".join([str(2048 // num_experts)] * num_experts)
        lines += [MOE.format(it=it, layer=layer, aux=1.2, dropped=0, counts=counts) for layer in (0, 1)]
    return "\n".join(lines) + "\n"


def test_expert_budget_exercise_check():
    cells = json.loads((REPO_ROOT / "notebooks" / "09_context_and_expert_parallelism.ipynb").read_text())[
        "cells"
    ]
    source = next("".join(c["source"]) for c in cells if "check_expert_budget(" in "".join(c["source"]))

    def run(text: str | None) -> str:
        job = None if text is None else type("Job", (), {"log": lambda self: text})()
        return run_cell(source, {"budget_job": job}, {"experts": experts})

    assert "[ok]" in run(budget_log(16, 566_912, last=5))  # ep = 4: 4 experts per rank
    for wrong in (
        budget_log(16, 831_616, last=5),  # ep = 2: over the budget
        budget_log(8, 565_888, last=5),  # 8 experts fit, but 16 were asked for
        budget_log(16, 566_912, last=3),  # the run stopped before its last iteration
        "pretrain_gpt.py: error: expert-model-parallel size 3 does not divide data-parallel size 4\n",
    ):
        with pytest.raises(ExerciseError):
            run(wrong)
    untouched = run(None)
    assert "[not yet]" in untouched and "[ok]" not in untouched


@pytest.fixture(scope="module")
def pipelined_runs(tmp_path_factory) -> dict[int, tuple[str, object]]:
    """Real PP = 2 (1F1B) runs of notebook 05's layers with m = 1 and m = 8 micro-batches of 8
    sequences of 128 per step (passes long enough next to a gloo send's latency on a loaded
    machine): {m: (log text, timeline path)}."""
    from distlab.local_runs import prepare_data, spawn_pretrain

    root = tmp_path_factory.mktemp("pipelined")
    data = prepare_data(root / "data", vocab_size=512, max_files=80).argv()
    model = "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128"
    runs = {}
    for m in (1, 8):
        timeline = root / f"m{m}.json"
        argv = [*data, *model.split(), "--max-position-embeddings", "128", "--train-iters", "2"]
        argv += ["--eval-iters", "0", "--eval-interval", "2", "--lr", "1e-3"]
        argv += [
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-schedule",
            "1f1b",
            "--micro-batch-size",
            "8",
        ]
        argv += ["--global-batch-size", str(8 * m), "--pipeline-timeline", str(timeline)]
        runs[m] = (spawn_pretrain(argv, 2, root / f"run{m}").log, timeline)
    return runs


def test_pipeline_exercise_check(pipelined_runs, capsys):
    """Notebook 05's exercise: the wrong m, the wrong micro batch and a timeline of another run
    fail; nothing submitted waits; the right run passes whatever the load, since m is read from the
    log and the measured bubble is only shown (its spread on 2 shared cores, 0.13 for one m, is
    larger than the step from m = 2 to m = 8: distlab.logs.exercise.BUBBLE_SPREAD)."""
    from distlab.logs.exercise import check_pipeline_run

    (log1, tl1), (log8, tl8) = pipelined_runs[1], pipelined_runs[8]
    with pytest.raises(ExerciseError, match="micro-batches per step: 1 is not right"):
        check_pipeline_run(log1, tl1, micro_batch=8, max_bubble=1 / 9)
    with pytest.raises(ExerciseError, match="micro batch: 8 is not right"):
        check_pipeline_run(log8, tl8, micro_batch=2, max_bubble=1 / 9)
    with pytest.raises(ExerciseError, match="micro-batches per step: 8 is not right"):  # m = 2 would do
        check_pipeline_run(log8, tl8, micro_batch=8, max_bubble=1 / 3)
    with pytest.raises(ExerciseError, match=r"the run's timeline .*: \(2, 1\) is not right.*8 micro-batches"):
        check_pipeline_run(log8, tl1, micro_batch=8, max_bubble=1 / 9)  # a stale timeline of m = 1
    assert check_pipeline_run(None, None, micro_batch=8, max_bubble=1 / 9) is False
    assert "[not yet]" in capsys.readouterr().out
    assert check_pipeline_run(log8, tl8, micro_batch=8, max_bubble=1 / 9) is True
    out = capsys.readouterr().out
    assert "[ok] the run's timeline" in out and "(shown, not checked)" in out and "= 0.11" in out
