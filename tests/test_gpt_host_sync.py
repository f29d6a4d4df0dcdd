"""A training step that does not log never waits for the device: the profiler's count of
``aten::_local_scalar_dense`` (what ``.item()``, ``float(t)`` and ``bool(t)`` of a tensor run, a
device synchronisation on a GPU) inside the traced iterations of whole pretraining runs on gloo
ranks, for data parallelism, TP 2 x PP 2 and FSDP2.

The trace's ``ProfilerStep#N`` spans iteration N's data, step and the logging of iteration N - 1
(``pretrain.train``); with ``--log-interval`` past the traced iterations none of them reads the
interval. The aim is 0 in bf16 and fp32; fp16 may read its overflow flag once per step.

Not counted: the reads inside torch's fused optimizer ops (``aten::_fused_adamw_``, ...), whose
CPU kernel reads each parameter's step count from host memory (no synchronisation: a CPU tensor
is host memory), while the CUDA kernel reads it inside the kernel from device memory
(``ATen/native/cuda/fused_adam_utils.cuh``: ``*step_count``). Any other read in the step, be it
``.item()`` in torch's foreach AdamW or ``float(loss)`` in the engine, counts.
"""

from __future__ import annotations

import json

import pytest

from distlab.gpt.training.log import ITERATION_RE
from distlab.local_runs import prepare_data, spawn_pretrain

pytestmark = pytest.mark.timeout(240)
TINY = [
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"),
    *("--micro-batch-size", "1", "--lr", "1e-3", "--split", "90,10,0", "--seed", "3"),
    *("--clip-grad", "1.0", "--eval-interval", "1000", "--eval-iters", "1"),
    # 6 iterations, the line at 6 only; traced: iterations 3 and 4 (warm-up on 2)
    *("--train-iters", "6", "--log-interval", "10", "--profile-execution", "True"),
    *("--profile-step-start", "2", "--profile-step-end", "4", "--profile-name", "sync"),
]
SCALAR_READ = "aten::_local_scalar_dense"
FUSED_OPTIMIZERS = {"aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=300, max_files=20).argv()


def scalar_reads_per_step(trace: dict) -> dict[str, int]:
    """``{"ProfilerStep#N": reads}``: the scalar reads inside each traced iteration's span, less
    those inside a fused optimizer's op (module docstring)."""
    events = trace["traceEvents"]
    spans = [e for e in events if "dur" in e]
    steps = [e for e in spans if e["name"].startswith("ProfilerStep#")]
    fused = [e for e in spans if e["name"] in FUSED_OPTIMIZERS]

    def inside(e: dict, span: dict) -> bool:
        return span["ts"] <= e["ts"] <= span["ts"] + span["dur"]

    reads = [e for e in spans if e["name"] == SCALAR_READ]
    reads = [e for e in reads if not any(inside(e, f) and f["tid"] == e["tid"] for f in fused)]
    return {s["name"]: sum(inside(e, s) for e in reads) for s in steps}


def traced_reads(data, tmp_path, world: int, flags: list[str]) -> list[dict[str, int]]:
    """Every rank's scalar reads per traced iteration of one run."""
    tb = tmp_path / "tb"
    argv = [*TINY, *data, "--tensorboard-dir", str(tb), "--profile-ranks", *map(str, range(world)), *flags]
    run = spawn_pretrain(argv, world, tmp_path / "run")
    lines = [m for m in (ITERATION_RE.match(line) for line in run.log.splitlines()) if m]
    assert [int(m["it"]) for m in lines] == [6]  # no line inside the traced iterations
    assert [int(m["skipped"]) for m in lines] == [0] and [int(m["nan"]) for m in lines] == [0]
    assert len(run.last["losses"]) == 6  # every iteration's values reached the history
    out = []
    for rank in range(world):
        (path,) = (tb / "sync").glob(f"rank{rank}.*.pt.trace.json")
        reads = scalar_reads_per_step(json.loads(path.read_text()))
        assert sorted(reads) == ["ProfilerStep#3", "ProfilerStep#4"], reads
        out.append(reads)
    return out


@pytest.mark.parametrize(
    ("world", "flags", "most"),
    [
        (2, ["--global-batch-size", "4", "--bf16"], 0),  # dp 2, 2 micro-batches
        (2, ["--global-batch-size", "2", "--fp16", "--initial-loss-scale", "1024"], 1),  # the overflow flag
        (4, ["--global-batch-size", "2", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2", "--bf16"], 0),  # 2 micro-batches through 1F1B
        (2, ["--global-batch-size", "2", "--use-torch-fsdp2"], 0),  # fp32
    ],
    ids=["dp2-bf16", "dp2-fp16", "tp2-pp2-bf16", "fsdp2-fp32"],
)  # fmt: skip
def test_a_step_that_does_not_log_reads_nothing_from_the_device(data, tmp_path, world, flags, most):
    per_rank = traced_reads(data, tmp_path, world, flags)
    assert all(n <= most for reads in per_rank for n in reads.values()), per_rank
