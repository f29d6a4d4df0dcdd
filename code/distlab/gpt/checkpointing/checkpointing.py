"""Megatron-layout checkpoints, written atomically, for exact resume.

Layout under ``--save`` (one file per tensor/pipeline rank; data-parallel rank 0 writes it)::

    latest_checkpointed_iteration.txt        "20"
    iter_0000020/mp_rank_00/model_optim_rng.pt          pp = 1: mp_rank_<tp>
    iter_0000020/mp_rank_00_001/model_optim_rng.pt      pp > 1: mp_rank_<tp>_<pp>

Atomicity: every rank writes into ``iter_0000020.tmp/``; after a barrier rank 0 renames the folder
to ``iter_0000020`` and only then replaces the tracker file (write to a temporary name,
``os.replace``). A job killed at any moment leaves the tracker naming a complete checkpoint.

A checkpoint holds the model, the optimizer, the loss scaler, the RNG states, the iteration and
the consumed samples; data order is a function of consumed samples, so a resumed run continues the
same trajectory. That is what ``torchrun --max-restarts N`` relies on: with ``--load`` equal to
``--save``, a restarted attempt resumes from the latest checkpoint by itself, and says so
(:func:`resume_line`).

This is ``--ckpt-format torch`` (the default; Megatron's legacy format). ``--ckpt-format
torch_dist`` (``dist_checkpointing.py``) writes sharded checkpoints with the same tracker and the
same atomic :func:`commit`.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from distlab.distributed import DistContext
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tensor_parallel.rng_tracker import get_rng_tracker

TRACKER = "latest_checkpointed_iteration.txt"
#: Arguments a checkpoint must agree on to be loaded.
MUST_MATCH = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "max_position_embeddings",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
)


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(folder: str, state: ParallelState) -> str:
    sub = (
        f"mp_rank_{state.tp_rank:02d}"
        if state.pp == 1
        else f"mp_rank_{state.tp_rank:02d}_{state.pp_rank:03d}"
    )
    return os.path.join(folder, sub, "model_optim_rng.pt")


def rng_state() -> dict:
    """This process's generators: torch (and CUDA), NumPy, Python, and the model-parallel
    stream of ``rng_tracker`` (Megatron's ``rng_tracker_states``)."""
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    rng["tracker"] = get_rng_tracker().get_states()
    return rng


def set_rng_state(rng: dict, *, tracker: bool = True) -> None:
    """Restore :func:`rng_state`; ``tracker=False`` keeps this process's model-parallel stream
    (another tp rank's saved one would repeat that rank's masks)."""
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if tracker and "tracker" in rng:  # checkpoints written before the tracker have none
        get_rng_tracker().set_states(rng["tracker"])


class Snapshot(NamedTuple):
    """What a save writes of the run at one iteration, besides its arguments: the one signature of
    every save (``save_checkpoint`` here and in ``dist_checkpointing.py``, ``Checkpointer.save``)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler_state: dict | None
    iteration: int
    consumed_samples: int


def save_checkpoint(args: PretrainArgs, state: ParallelState, saved: Snapshot) -> str:
    """Write ``iter_<iteration>`` under ``args.save`` atomically; return its folder."""
    model, optimizer, scaler_state, iteration, consumed_samples = saved
    final = checkpoint_dir(args.save, iteration)
    tmp = final + ".tmp"
    if state.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a killed save
    dist.barrier()
    if state.dp_rank == 0 and state.cp_rank == 0:  # cp ranks hold the same weights
        path = rank_file(tmp, state)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(
            {
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler_state,
                "rng": rng_state(),
                "args": dataclasses.asdict(args),
            },
            path,
        )
    dist.barrier()
    if state.rank == 0:
        commit(args.save, iteration)
    dist.barrier()
    return final


def commit(root: str, iteration: int) -> str:
    """Rename the complete ``iter_<iteration>.tmp`` to ``iter_<iteration>``, then point the tracker
    at it (one process, after every rank has written); return the folder."""
    final = checkpoint_dir(root, iteration)
    if os.path.exists(final):  # re-saving an iteration: keep the old one until the new is in place
        os.replace(final, final + ".old")
    os.replace(final + ".tmp", final)
    shutil.rmtree(final + ".old", ignore_errors=True)
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    return final


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def load_checkpoint(
    args: PretrainArgs,
    state: ParallelState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[int, int, dict | None] | None:
    """Restore from ``args.load``; return ``(iteration, consumed_samples, scaler_state)``, or None
    when the folder holds no checkpoint yet (a fresh start, as Megatron does)."""
    iteration = read_tracker(args.load)
    if iteration is None:
        return None
    folder = checkpoint_dir(args.load, iteration)
    path = rank_file(folder, state)
    if os.path.exists(os.path.join(folder, ".metadata")):  # DCP's
        raise FileNotFoundError(
            f"{folder} was written with --ckpt-format torch_dist (torch.distributed.checkpoint): "
            f"load it with --ckpt-format torch_dist"
        )
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint was written with another tensor/pipeline "
            f"layout than tp={state.tp} pp={state.pp}"
        )
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    check_args(ckpt["args"], args, path)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    set_rng_state(ckpt["rng"])
    return ckpt["iteration"], ckpt["consumed_samples"], ckpt["scaler"]


def check_args(saved: dict, args: PretrainArgs, path: str, *, may_differ: tuple[str, ...] = ()) -> None:
    """Raise naming every argument of :data:`MUST_MATCH` (but ``may_differ``) on which the
    checkpoint and the run differ."""
    diffs = [
        f"--{k.replace('_', '-')} {saved.get(k)} (checkpoint) vs {getattr(args, k)} (now)"
        for k in MUST_MATCH
        if k not in may_differ and saved.get(k) != getattr(args, k)
    ]
    if diffs:
        raise ValueError(f"checkpoint {path} does not fit this run: " + "; ".join(diffs))


def resume_line(load: str, iteration: int | None, ctx: DistContext) -> str:
    """The start-up line about ``--load``: the checkpoint's iteration (``None``: none yet), and for
    an attempt that torchrun restarted, which restart it is and what gets recomputed."""
    if ctx.restart == 0:
        if iteration is None:
            return f"> no checkpoint in {load}: starting from scratch"
        return f"> loaded checkpoint from {load} at iteration {iteration}"
    restart = f"> restart {ctx.restart} of torchrun's --max-restarts {ctx.max_restarts}"
    if iteration is None:
        return (
            f"{restart}: no checkpoint in {load} yet, starting from scratch (iterations from 1 on recomputed)"
        )
    return (
        f"{restart}: resuming from iteration {iteration}, the latest checkpoint in {load} "
        f"(iterations from {iteration + 1} to where the previous attempt stopped are recomputed)"
    )
