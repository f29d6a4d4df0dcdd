"""Notebook 08's changed check cells, run from the committed notebook's source on logs written by
the engine's own formatters: what the run printed passes, a wrong run fails.

* placement (section 1): B's ranks print their own nodes; a TP pair split over two nodes, or a
  rank without its line, fails;
* asynchronous save (section 4): the async save must block the step less than the sync save;
  one that waited for its write (as long as the sync one) fails;
* torch.compile (section 6): the first compiled iteration pays for the compile, once; a run
  whose every iteration costs as much (recompiling) or whose first costs no more fails.
"""

from __future__ import annotations

import json

import matplotlib
import matplotlib.pyplot
import numpy as np
import pytest

from distlab import REPO_ROOT
from distlab.gpt.checkpointing.checkpointer import SAVED
from distlab.gpt.native.torch_compile import COMPILE
from distlab.gpt.training.log import iteration_line
from distlab.logs import megatron, placement

matplotlib.use("Agg")
CELLS = [
    "".join(c["source"])
    for c in json.loads((REPO_ROOT / "notebooks" / "08_pytorch_native_parallelism.ipynb").read_text())[
        "cells"
    ]
]


def _cell(start: str) -> str:
    (src,) = [s for s in CELLS if s.startswith(start)]
    return src


class _Job:
    def __init__(self, text: str) -> None:
        self.text = text

    def log(self) -> str:
        return self.text


def _iterations(ms: list[float], loss0: float = 8.0) -> str:
    n = len(ms)
    return "\n".join(
        iteration_line(
            iteration=i + 1,
            train_iters=n,
            consumed_samples=8 * (i + 1),
            elapsed_ms=t,
            lr=1e-3,
            global_batch_size=8,
            loss=loss0 - i / 10,
            loss_scale=1.0,
            grad_norm=1.0,
            skipped=0,
            nan=0,
            tokens_per_s=1000.0,
            tflops_per_device=0.001,
            mfu=None,
        )  # fmt: skip
        for i, t in enumerate(ms)
    )


def _rank_lines(hosts: dict[int, str]) -> str:
    return "\n".join(
        f"> rank {r} on {h} (torchrun node rank {r // 2}, local rank {r % 2})" for r, h in hosts.items()
    )


def _native(b_hosts: dict[int, str]) -> str:
    mesh = "> DeviceMesh (pp, dp, tp) = (1, 2, 2), ranks by (pp, dp, tp): [[[0, 1], [2, 3]]]"
    return "\n".join(
        ["=== A: FSDP2, dp 4", _rank_lines({0: "node1", 1: "node1", 2: "node2", 3: "node2"}),
         "=== B: FSDP2 dp 2 x DTensor TP 2 + SP", _rank_lines(b_hosts), mesh, "=== C: DeepSpeed ZeRO-3"]
    )  # fmt: skip


def _run_placement(text: str) -> None:
    exec(_cell("text = native.log()"), {"native": _Job(text), "placement": placement, "np": np, "json": json})


def test_placement_passes_tp_pairs_inside_a_node_whichever_node_got_ranks_0_and_1():
    _run_placement(_native({0: "node2", 1: "node2", 2: "node1", 3: "node1"}))
    _run_placement(_native({0: "node1", 1: "node1", 2: "node2", 3: "node2"}))


def test_placement_fails_on_a_split_tp_pair_or_a_missing_line():
    with pytest.raises(AssertionError, match="a TP group spans nodes"):
        _run_placement(_native({0: "node1", 1: "node2", 2: "node1", 3: "node2"}))
    with pytest.raises(AssertionError, match="a host line per rank of B"):
        _run_placement(_native({0: "node1", 1: "node1", 2: "node2"}))


def _saved(mode: str | None, blocking: float, total: float) -> str:
    fields = dict(iteration=6, folder="/ckpt", format="torch_dist", blocking_ms=blocking, total_ms=total)
    return SAVED.format(**fields, **({"mode": mode} if mode else {}))


def _run_save(sync_ms: float, async_blocking_ms: float, async_total_ms: float) -> None:
    runs = {"A": _saved(None, sync_ms, sync_ms), "B": _saved("async", async_blocking_ms, async_total_ms)}
    exec(
        _cell("from distlab.gpt.checkpointing.checkpointer import SAVED"),
        {"runs": runs, "np": np, "plt": matplotlib.pyplot},
    )


def test_the_async_save_must_return_before_its_files_are_written():
    _run_save(356.0, 212.0, 1068.0)  # a CI run
    _run_save(232.0, 274.0, 881.0)  # a loaded run: B's save blocked longer than A's, and still overlapped
    with pytest.raises(AssertionError, match="did it wait for its write"):
        _run_save(356.0, 360.0, 355.0)  # written before the step went on


def _compile_log(eager: list[float], compiled: list[float]) -> str:
    summary = COMPILE.format(
        first_ms=compiled[0], steady_ms=float(np.median(compiled[1:])), n=len(compiled) - 1
    )
    return f"=== eager\n{_iterations(eager)}\n=== compiled\n{_iterations(compiled)}\n{summary}"


def _run_compile(eager: list[float], compiled: list[float]) -> None:
    job = _Job(_compile_log(eager, compiled))
    exec(_cell("from distlab.gpt.native.torch_compile import COMPILE"),
         {"compiled_job": job, "megatron": megatron, "np": np, "plt": matplotlib.pyplot, "PROCS": 2, "BACKEND": "gloo"})  # fmt: skip


def test_the_compiled_run_pays_for_one_compile():
    _run_compile([239.3, 123.9, 202.1, 151.2, 147.9, 107.6], [109344.4, 127.4, 137.9, 173.0, 155.6, 183.5])
    with pytest.raises(AssertionError, match="did not pay for a compile"):  # compiled in every iteration
        _run_compile(
            [239.3, 123.9, 202.1, 151.2, 147.9, 107.6], [3000.0, 2900.0, 3100.0, 2800.0, 3000.0, 2950.0]
        )
    with pytest.raises(AssertionError, match="did not pay for a compile"):  # not compiled at all
        _run_compile([239.3, 123.9, 202.1, 151.2, 147.9, 107.6], [241.0, 125.0, 200.0, 150.0, 149.0, 110.0])
