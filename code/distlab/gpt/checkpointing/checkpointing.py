"""Megatron-layout checkpoints, written atomically, for exact resume.

Layout under ``--save`` (one file per tensor/pipeline rank; data-parallel rank 0 writes it)::

    latest_checkpointed_iteration.txt        "20"
    iter_0000020/mp_rank_00/model_optim_rng.pt          pp = 1: mp_rank_<tp>
    iter_0000020/mp_rank_00_001/model_optim_rng.pt      pp > 1: mp_rank_<tp>_<pp>
    iter_0000020/mp_rank_00_001_001/model_optim_rng.pt  ep > 1: ..._<ep rank> (Megatron's suffix)

With expert parallelism the ep ranks of the first ep block of each dp x cp group write (each holds
other experts, the dense weights alike: Megatron's expert-data-parallel rank 0), and every rank
reads the file of its (tp, pp, ep) place.

Atomic and durable (:func:`commit`, with ``durable.py``): a job killed, or a node losing power,
at any moment of a save leaves the tracker naming a complete checkpoint::

    every writing rank   torch.save into iter_0000020.tmp/..., fsync the file and its folder
    barrier; rank 0      fsync everything under iter_0000020.tmp
                         iter_0000020.tmp -> iter_0000020: a rename, or when iter_0000020
                         exists (a re-save) an atomic exchange of the two folders
                         fsync --save (the rename is on disk)
                         tracker: write a temporary file, fsync, os.replace, fsync --save
                         only then remove the previous iter_0000020 (now under .tmp)

Where the file system cannot exchange two folders (``renameat2`` refused) the re-save sets the
old folder aside as ``iter_0000020.old`` and renames the new one into place; between the two
renames the tracker's folder is missing and :func:`committed_dir` reads the old one.

A checkpoint holds the model, the optimizer, the loss scaler, the RNG states, the iteration and
the consumed samples; data order is a function of consumed samples, so a resumed run continues the
same trajectory. That is what ``torchrun --max-restarts N`` relies on: with ``--load`` equal to
``--save``, a restarted attempt resumes from the latest checkpoint by itself, and says so
(:func:`resume_line`).

With ``--use-distributed-optimizer`` the optimizer's entry holds every bucket's fp32 main parameters
and moments gathered whole from the dp x cp shards (as Megatron's ``dp_reshardable`` torch format):
a run saved with dp 4 loads with dp 2, each rank taking its new shard.

This is ``--ckpt-format torch`` (Megatron's legacy format). ``--ckpt-format torch_dist`` (the
default, as Megatron-LM's; ``dist_checkpointing.py``) writes sharded checkpoints with the same
tracker and the same atomic :func:`commit`. The flag chooses how a run saves; ``--load`` reads
the format it finds (:func:`saved_format`, Megatron's ``_get_checkpoint_format``), so a release
checkpoint, always in this layout, loads into a run that saves torch_dist.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from distlab.distributed import DistContext
from distlab.gpt.checkpointing import durable
from distlab.gpt.checkpointing.checkpoint_config import CheckpointConfig
from distlab.gpt.optimizer.distrib_optimizer import DistributedOptimizer
from distlab.gpt.optimizer.optimizer import is_dtensor
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.tensor_parallel.rng_tracker import get_rng_tracker

TRACKER = "latest_checkpointed_iteration.txt"
#: The tracker's word for a model-only checkpoint in ``release/`` (Megatron's: what its converters
#: write, and ``code/convert_checkpoint.py``): loaded at iteration 0, without optimizer or RNG.
RELEASE = "release"
#: The fix named when a torch_dist reader meets this layout.
READS_TORCH = "checkpointing.load_checkpoint reads it, as a run's --load does (it reads the format it finds)"
#: Arguments a checkpoint must agree on to be loaded.
MUST_MATCH = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "max_position_embeddings",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
)


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(folder: str, state: ParallelState) -> str:
    sub = (
        f"mp_rank_{state.tp_rank:02d}"
        if state.pp == 1
        else f"mp_rank_{state.tp_rank:02d}_{state.pp_rank:03d}"
    )
    if state.ep > 1:
        sub += f"_{state.ep_rank:03d}"
    return os.path.join(folder, sub, "model_optim_rng.pt")


def writes_checkpoint(state: ParallelState) -> bool:
    """Data-parallel rank 0 of cp rank 0 (cp ranks hold the same weights); with ep > 1 the first ep
    ranks of the dp x cp group, which hold every expert once (expert-data-parallel rank 0)."""
    if state.ep == 1:
        return state.dp_rank == 0 and state.cp_rank == 0
    return state.dp_rank * state.cp + state.cp_rank < state.ep


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


def save_checkpoint(config: CheckpointConfig, state: ParallelState, saved: Snapshot) -> str:
    """Write ``iter_<iteration>`` under ``config.save`` atomically; return its folder."""
    model, optimizer, scaler_state, iteration, consumed_samples = saved
    final = checkpoint_dir(config.save, iteration)
    tmp = final + ".tmp"
    if state.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a killed save
    dist.barrier()
    optim = optimizer.state_dict()  # every rank: the distributed optimizer gathers its shards
    if writes_checkpoint(state):
        path = rank_file(tmp, state)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        ckpt = {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "model": model.state_dict(),
            "optimizer": optim,
            "scaler": scaler_state,
            "rng": rng_state(),
            "args": config.arguments,
        }
        durable.write_file(path, lambda f: torch.save(ckpt, f))  # on disk before the barrier
    dist.barrier()
    if state.rank == 0:
        commit(config.save, iteration)
    dist.barrier()
    return final


def commit(root: str, iteration: int) -> str:
    """Put the complete ``iter_<iteration>.tmp`` in place of ``iter_<iteration>``, durably, then
    point the tracker at it, then remove what it replaced (one process, after every rank has
    written); return the folder. Every step leaves the tracker naming a complete checkpoint."""
    final = checkpoint_dir(root, iteration)
    tmp, old = final + ".tmp", final + ".old"
    durable.fsync_tree(tmp)  # every rank's files and folders, before a name points at them
    if not os.path.exists(final):
        os.replace(tmp, final)  # old: a fallback re-save's folder, left by a crash (see below)
        replaced = [old]
    elif durable.exchange(tmp, final):  # re-save: new and old swap places in one step
        replaced = [tmp, old]
    else:  # no exchange on this file system: set the old aside, committed_dir reads it meanwhile
        if os.path.exists(old):  # left by a crashed re-save after its second rename: final is whole
            durable.fsync_path(root)
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        replaced = [old]
    durable.fsync_path(root)  # the new folder's name is on disk
    durable.replace_file(os.path.join(root, TRACKER), str(iteration).encode())
    for folder in replaced:  # the previous checkpoint goes only now that the tracker is durable
        shutil.rmtree(folder, ignore_errors=True)
    return final


def committed_dir(root: str, iteration: int) -> str:
    """The folder of the committed ``iteration``: ``iter_<iteration>``, or while a re-save without
    an atomic exchange has set it aside, ``iter_<iteration>.old`` (see :func:`commit`)."""
    final = checkpoint_dir(root, iteration)
    if not os.path.exists(final) and os.path.isdir(final + ".old"):
        return final + ".old"
    return final


def is_release(root: str) -> bool:
    """Whether ``root``'s tracker names a release checkpoint (:data:`RELEASE`)."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return f.read().strip() == RELEASE


def saved_format(root: str) -> str | None:
    """The format of the checkpoint that ``root``'s tracker names, from its folder (Megatron's
    ``_get_checkpoint_format``): torch_dist where DCP's ``.metadata`` is, torch where ``mp_rank_*``
    folders are (a release checkpoint's); None without a tracker, or with neither."""
    if is_release(root):
        return "torch"
    iteration = read_tracker(root)
    if iteration is None:
        return None
    folder = committed_dir(root, iteration)
    if os.path.exists(os.path.join(folder, ".metadata")):
        return "torch_dist"
    if os.path.isdir(folder) and any(name.startswith("mp_rank_") for name in os.listdir(folder)):
        return "torch"
    return None


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
    config: CheckpointConfig,
    state: ParallelState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[int, int, dict | None] | None:
    """Restore from ``config.load``; return ``(iteration, consumed_samples, scaler_state)``, or None
    when the folder holds no checkpoint yet (a fresh start, as Megatron does). A release checkpoint
    restores the model only: ``(0, 0, None)``, the optimizer and the RNG left as the run made them."""
    release = is_release(config.load)
    iteration = 0 if release else read_tracker(config.load)
    if iteration is None:
        return None
    folder = os.path.join(config.load, RELEASE) if release else committed_dir(config.load, iteration)
    path = rank_file(folder, state)
    if os.path.exists(os.path.join(folder, ".metadata")):  # DCP's
        raise FileNotFoundError(
            f"{folder} was written with --ckpt-format torch_dist (torch.distributed.checkpoint): "
            f"dist_checkpointing.load_checkpoint reads it, as a run's --load does (it reads the format it finds)"
        )
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint was written with another tensor/pipeline "
            f"layout than tp={state.tp} pp={state.pp}"
        )
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(
            f"{folder} was written with --ckpt-format torch (whole tensors, one file per tp x pp rank) and "
            f"this run's parameters are DTensors (--use-torch-fsdp2, --tensor-parallel-impl dtensor), which "
            f"load --ckpt-format torch_dist checkpoints only: load it in a run without those flags, which "
            f"saves in torch_dist (the default), then load that one"
        )
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    check_args(ckpt["args"], config.arguments, path)
    model.load_state_dict(ckpt["model"])
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.main_from_params()
    if release:
        return 0, 0, None
    if not config.no_load_optim:  # Megatron's --no-load-optim: fresh Adam moments and loss scale
        if "distributed_optimizer" in ckpt["optimizer"] and not isinstance(optimizer, DistributedOptimizer):
            raise ValueError(
                f"{path} holds a distributed optimizer's state (--use-distributed-optimizer): load "
                f"it with --use-distributed-optimizer, or with --no-load-optim"
            )
        optimizer.load_state_dict(ckpt["optimizer"])
    if not config.no_load_rng:
        set_rng_state(ckpt["rng"])
    return ckpt["iteration"], ckpt["consumed_samples"], None if config.no_load_optim else ckpt["scaler"]


def check_args(saved: dict, now: dict, path: str, *, may_differ: tuple[str, ...] = ()) -> None:
    """Raise naming every argument of :data:`MUST_MATCH` (but ``may_differ``) on which the
    checkpoint's arguments (``saved``) and the run's (``now``) differ."""
    diffs = [
        f"--{k.replace('_', '-')} {saved.get(k)} (checkpoint) vs {now.get(k)} (now)"
        for k in MUST_MATCH
        if k not in may_differ and saved.get(k) != now.get(k)
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
