"""Shared fixtures: the local cluster (skipped with a reason where Slurm is not running), and
gloo ranks spawned on this machine (:func:`run_gloo`, :func:`gloo_group`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator

import pytest
import torch

from distlab import REPO_ROOT
from distlab.distributed import DistContext, init_distributed, shutdown
from distlab.local_ranks import free_port, spawn_ranks, torchrun_env


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "mostly_waits: spends its time waiting (on its own Slurm cluster, JupyterHub or JupyterLab, on "
        "Slurm's timers, or on a process group's timeout), not computing; ./lab test runs these beside "
        "the other tests",
    )
    config.addinivalue_line(
        "markers",
        "engine_fast: a module of the GPT engine's unit tests that spawns no ranks and no run and takes "
        "seconds (`pytest -m engine_fast`: the engine's quick check, about a minute on 2 cores)",
    )


def cluster_available() -> bool:
    if shutil.which("sinfo") is None:
        return False
    env = {**os.environ, "SLURM_CONF": str(REPO_ROOT / ".lab" / "cluster" / "slurm.conf")}
    try:
        out = subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0


@pytest.fixture
def slurm_cluster(monkeypatch):
    """The running local cluster; the test is skipped (with the fix) when there is none."""
    if not cluster_available():
        pytest.skip("no Slurm cluster answers: run `./lab cluster start` (./lab test does)")
    monkeypatch.setenv("LAB_ROOT", str(REPO_ROOT))
    monkeypatch.setenv("SLURM_CONF", str(REPO_ROOT / ".lab" / "cluster" / "slurm.conf"))
    return REPO_ROOT


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int, timeout_s: float = 60) -> Iterator[DistContext]:
    """Rank ``rank`` of a ``world``-rank gloo group on ``port``, shut down on exit, even on error.

    Sets torchrun's variables in this process (:func:`~distlab.local_ranks.torchrun_env`): call it
    in a spawned rank, never in the pytest process.
    """
    os.environ.update(torchrun_env(rank, world, port))
    try:
        yield init_distributed("gloo", timeout_s=timeout_s)
    finally:
        shutdown()


def _gloo_rank(rank: int, world: int, port: int, timeout_s: float, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores
    with gloo_group(rank, world, port, timeout_s) as ctx:
        fn(ctx, *args)


#: The tiny GPT every whole-run equivalence test trains (data flags and the layout left out).
TINY_GPT_ARGV = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 "
    "--make-vocab-size-divisible-by 128 --seed 1234 --split 949,50,1 --log-interval 1 "
    "--eval-interval 3 --eval-iters 1 --attention-dropout 0 --hidden-dropout 0 --distributed-backend gloo"
).split()


def run_gloo(fn: Callable[..., None], world: int, *args, timeout_s: float = 60) -> None:
    """Run ``fn(ctx, *args)`` on ``world`` spawned ranks of one gloo group on a free port.

    ``ctx`` is the rank's :class:`~distlab.distributed.DistContext`; each rank computes on one
    thread. A rank that raises (a failed ``assert`` included) fails the call with its traceback.
    ``fn`` must be a module-level function: the ranks are spawned, not forked (torch's thread pool
    does not survive a fork), and import it.
    """
    spawn_ranks(_gloo_rank, (world, free_port(), timeout_s, fn, args), world)


def assert_same_training(history: dict, reference: dict, what: str, tol: float = 1e-6) -> None:
    """A run's losses, gradient norms and validation losses equal the reference run's within
    ``rtol = atol = tol`` (fp32 round-off of a different order of sums)."""
    for key in ("losses", "grad_norms", "val_losses"):
        torch.testing.assert_close(
            torch.tensor(history[key], dtype=torch.float64),
            torch.tensor(reference[key], dtype=torch.float64),
            rtol=tol,
            atol=tol,
            msg=lambda m, key=key: f"{what}: {key} differ from one process: {m}",
        )


def train_plan(rank: int, plan: list, out: str) -> None:
    """A spawned rank's part of ``plan``, runs ``(name, world, argv, port)`` one after another: each
    run with ``world`` ranks trains through the whole driver; its history goes to
    ``out/<name>.rank<rank>.json`` and its log beside it. A ``port`` of None is picked when the run
    starts (:func:`_run_port`): a long plan's ports picked when it is made may be another process's
    by the time their run comes, on a busy machine (EADDRINUSE)."""
    import json
    from pathlib import Path

    from distlab.local_runs import pretrain_as_rank

    torch.set_num_threads(1)
    for name, world, argv, port in plan:
        if rank < world:
            port = port or _run_port(rank, Path(out, f"{name}.port"))
            history = pretrain_as_rank(rank, world, port, argv, Path(out, f"{name}.rank{rank}.log"))
            Path(out, f"{name}.rank{rank}.json").write_text(json.dumps(history))


def _run_port(rank: int, path) -> int:
    """A free port for one run: rank 0 picks it and writes ``path`` (atomically), the others read it."""
    import time

    if rank == 0:
        path.with_suffix(".tmp").write_text(str(free_port()))
        os.replace(path.with_suffix(".tmp"), path)
    while not path.exists():
        time.sleep(0.01)
    return int(path.read_text())


def entry_script(name: str):
    """An entry script of code/ (``generate``, ``convert_checkpoint``) as a module, to call its
    ``main`` in this process (the tests then see which functions it reaches)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "code" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_weights_read(monkeypatch):
    """Reaching a weight of a checkpoint fails the test: every refusal of a bad input must come before."""
    from distlab.gpt.inference import course_checkpoint, hf_checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the input was refused")

    monkeypatch.setattr(hf_checkpoint, "read_weights", refuse)
    monkeypatch.setattr(course_checkpoint, "read_model", refuse)
