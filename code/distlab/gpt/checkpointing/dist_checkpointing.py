"""``--ckpt-format torch_dist``: sharded checkpoints with ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own part; a checkpoint written by N ranks loads into M. Under ``--save``
(the folder Megatron-LM's torch_dist writes: DCP's files and a ``common.pt``)::

    latest_checkpointed_iteration.txt   "6" (the same tracker as --ckpt-format torch)
    iter_0000006/.metadata              DCP's index: every tensor's global shape and dtype, and
                                        which chunk (offsets, sizes) lies in which file where
    iter_0000006/__0_0.distcp           rank 0's chunks (FSDP2: its rows of every parameter and
    iter_0000006/__1_0.distcp           Adam moment; plain dp: each replicated tensor once)
    iter_0000006/common.pt              iteration, consumed samples, loss scaler, arguments and
                                        every rank's RNG states (rank 0, torch.save)

Saving: ``get_state_dict(model, optimizer)`` (here its two halves, ``get_model_state_dict`` and
``get_optimizer_state_dict``) returns both state dicts keyed by parameter name (the optimizer's
too, its param_groups included: :data:`OPTIONS`), FSDP2's parameters and moments as ``Shard(0)``
DTensors, the plain engine's as whole tensors. ``dcp.save`` plans from them: a
DTensor is its rank's chunk at its offset in the global tensor, a whole tensor that the dp ranks
hold alike is written by one of them. Loading: ``dcp.load`` fills the state dicts of the run that
loads, whatever their sharding: each rank asks for its chunks and DCP reads the overlapping parts
of the saved ones (2 FSDP2 ranks -> 1 plain rank: both files' rows); ``set_state_dict``'s halves
put them in the model and the optimizer. Pipeline stages save different names (``wte.weight`` on
the first, ``output_weight`` on the last), so pp works too, with the same pp on load. The
hand-written tensor parallelism's shards, plain tensors of one name on every tp rank, go to DCP
with their places in the one-process tensor (``tp_chunks``: SwiGLU's ``[gate_r; up_r]`` as two
chunks), so a tp 2 checkpoint loads at tp 1 as Megatron's torch_dist does, if both pad the
vocabulary to the same size (checked). Context-parallel ranks hold the same weights and optimizer
state, as the dp ranks do: DCP writes each chunk once. Expert parallelism: each ep rank's experts
carry their global index in their names (``layers.<i>.mlp.experts.<e>``, ``MoELayer``), so the
ep ranks write distinct keys and their expert-data-parallel replicas one chunk each; a checkpoint
of ep 2 loads at ep 1 (every expert on each rank) or 4. The distributed optimizer's buckets
(``distrib_buckets.py``: an expert bucket keyed by its ep rank) reshard over dp x cp only
(Megatron's ``dp_reshardable``). DTensor's (``--tensor-parallel-impl dtensor``) are DTensors: a
checkpoint of FSDP2 over 4 ranks loads into TP 2 (x FSDP2), or 1 rank.

Atomic and durable as the torch format: everything is written into ``iter_0000006.tmp/`` (DCP
fsyncs every rank's files, its ``FileSystemWriter(sync_files=True)`` default; ``common.pt`` is
fsynced too); once DCP's ``.metadata`` is there (it is written last, after every rank's data),
rank 0 fsyncs the folder, puts it in place and then the tracker (``checkpointing.commit``).

``--async-save`` (``dcp.async_save``): the save blocks for the state dicts, ``common.pt`` and
the copy of every tensor to CPU memory (DCP's stager: the next steps change the parameters);
DCP's planning and writes then run in a thread, on a gloo group of their own (two threads must
not share a group's collectives), while training goes on. The next save and the end of training
wait for it; rank 0 commits as soon as the write is complete. The save line gives both times,
``blocking`` (what the training loop waited, the previous save's end included) and ``total``
(until committed)::

      successfully saved checkpoint at iteration       6 to ckpt in torch_dist format (async) | blocking 9.8 ms | total 61.0 ms

The run's saves and loads in either format go through ``checkpointer.py``, which imports this
module only for ``torch_dist`` (the default, as Megatron-LM's).
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from distlab.gpt.checkpointing import checkpointing, distrib_buckets, durable, tp_chunks
from distlab.gpt.checkpointing.checkpoint_config import CheckpointConfig
from distlab.gpt.checkpointing.checkpointing import Snapshot
from distlab.gpt.optimizer.distrib_optimizer import DistributedOptimizer
from distlab.gpt.parallel_state import ParallelState

COMMON = "common.pt"  # Megatron-LM's name for the state every rank shares


#: The optimizer's param_groups keyed by parameter name too (``param_groups.<name>.lr``): the
#: groups of two pipeline stages hold different parameters, and would otherwise share a key.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _coords(state: ParallelState) -> tuple[int, int, int]:
    return state.tp_rank, state.pp_rank, state.dp_rank


def _state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState, *, with_optimizer: bool
) -> dict:
    """What DCP saves, or loads into: ``{"model": ..., "optimizer": ...}`` by parameter name (FSDP2:
    DTensor shards; the hand-written tp's shards placed in the whole tensors, ``tp_chunks``),
    ``get_state_dict``'s two halves. An optimizer that has not stepped yet (only fp16 overflows so
    far) is left out: ``get_optimizer_state_dict`` would give it a state by stepping it with lr 0,
    and Adam's step count would then differ from the uninterrupted run's."""
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.buffer.finish_param_sync()
    # the hand-written tp's shards (DTensor TP's model is built whole: its E and output layer too)
    tp, tp_rank = (state.tp, state.tp_rank) if getattr(model, "tp_group", None) is not None else (1, 0)
    state_dict = {
        "model": tp_chunks.place_model(get_model_state_dict(model, options=OPTIONS), model, tp, tp_rank)
    }
    if with_optimizer and isinstance(optimizer, DistributedOptimizer):  # its bucket shards
        state_dict["optimizer"] = {"distrib": distrib_buckets.state(optimizer)}
    elif with_optimizer:
        flat = get_optimizer_state_dict(model, optimizer, options=OPTIONS)
        state_dict["optimizer"] = tp_chunks.place_optimizer(flat, model, tp, tp_rank)
    return state_dict


def _check_vocabulary(model: dict, saved: dict, folder: str, then: dict, now: dict) -> None:
    """The padded vocabulary V (a multiple of ``--make-vocab-size-divisible-by`` x tp) saved must be
    this run's before ``dcp.load`` reads any: the padded rows enter the softmax, so a tp that pads
    otherwise trains another model (DCP would only say that the sizes differ)."""
    for name in ("wte.weight", "output_layer.weight", "output_weight"):
        if name not in model or f"model.{name}" not in saved:
            continue
        rows, mine = saved[f"model.{name}"].size[0], model[name]
        want = getattr(mine, "global_shape", mine.shape)[0]  # tp_chunks' whole, else the tensor's own
        if rows == want:
            continue
        divisible, tp = (
            then["make_vocab_size_divisible_by"] * then["tensor_model_parallel_size"],
            now["tensor_model_parallel_size"],
        )
        fix = (
            f"give --make-vocab-size-divisible-by {divisible // tp}"
            if divisible % tp == 0
            else f"give a --make-vocab-size-divisible-by that pads to {rows} at tp {tp}"
        )
        raise ValueError(
            f"{folder} holds a padded vocabulary of {rows} rows ({name}: --make-vocab-size-divisible-by "
            f"{then['make_vocab_size_divisible_by']} x tp {then['tensor_model_parallel_size']}) and this run "
            f"pads to {want} (--make-vocab-size-divisible-by {now['make_vocab_size_divisible_by']} x tp {tp}): "
            f"the padded rows enter the softmax; {fix}"
        )


def _prepare(config: CheckpointConfig, state: ParallelState, saved: Snapshot) -> tuple[str, dict]:
    """Write ``common.pt`` into a fresh ``iter_<iteration>.tmp`` (rank 0); return the folder and
    this rank's state dict for DCP (collective: every rank's RNG reaches rank 0).

    Rank 0 clears the folder before the all-gather, and no rank leaves the all-gather before rank 0
    has joined it: DCP's local plan creates the folder on every rank, so a rank already in
    ``dcp.save`` must not meet rank 0's ``rmtree``/``makedirs`` (FileExistsError, or its files gone)."""
    model, optimizer, scaler_state, iteration, consumed_samples = saved
    tmp = checkpointing.checkpoint_dir(config.save, iteration) + ".tmp"
    if state.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a killed save
        os.makedirs(tmp)
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, (_coords(state), checkpointing.rng_state()))
    if state.rank == 0:
        common = {"iteration": iteration, "consumed_samples": consumed_samples, "scaler": scaler_state,
                  "rng": dict(rngs), "args": config.arguments}  # fmt: skip
        durable.write_file(os.path.join(tmp, COMMON), lambda f: torch.save(common, f))
    with_optimizer = isinstance(optimizer, DistributedOptimizer) or bool(optimizer.state)
    return tmp, _state_dict(model, optimizer, state, with_optimizer=with_optimizer)


def save_checkpoint(config: CheckpointConfig, state: ParallelState, saved: Snapshot) -> str:
    """``dcp.save`` into ``iter_<iteration>.tmp``, then commit (rank 0); return the folder."""
    tmp, state_dict = _prepare(config, state, saved)
    dcp.save(state_dict, checkpoint_id=tmp)  # returns on every rank once .metadata is written
    if state.rank == 0:
        checkpointing.commit(config.save, saved.iteration)
    dist.barrier()
    return tmp.removesuffix(".tmp")


def async_save_checkpoint(
    config: CheckpointConfig, state: ParallelState, saved: Snapshot, *, group: dist.ProcessGroup
) -> Future:
    """``dcp.async_save``: stage to CPU memory, return; a thread writes (collectives on the gloo
    ``group``), then rank 0 commits. The future holds the ``time.perf_counter()`` of the commit."""
    tmp, state_dict = _prepare(config, state, saved)
    written = dcp.async_save(state_dict, checkpoint_id=tmp, process_group=group)  # staged when it returns
    committed: Future = Future()

    def commit(future: Future) -> None:  # in DCP's thread, once this rank's part of the save is done
        try:
            future.result()  # every rank's data and .metadata are written
            if state.rank == 0:
                checkpointing.commit(config.save, saved.iteration)
            committed.set_result(time.perf_counter())
        except BaseException as exc:  # raised where the run waits for the save
            committed.set_exception(exc)

    written.add_done_callback(commit)
    return committed


def load_checkpoint(
    config: CheckpointConfig,
    state: ParallelState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[int, int, dict | None] | None:
    """Restore from ``config.load`` in the run's own sharding; return ``(iteration,
    consumed_samples, scaler_state)``, or None when the folder holds no checkpoint yet."""
    if checkpointing.is_release(config.load):
        raise FileNotFoundError(
            f"{config.load} holds a release checkpoint (model only, one file per tp x pp rank, as "
            f"convert_checkpoint.py writes) in the --ckpt-format torch layout: {checkpointing.READS_TORCH}"
        )
    iteration = checkpointing.read_tracker(config.load)
    if iteration is None:
        return None
    folder = checkpointing.committed_dir(config.load, iteration)
    if not os.path.exists(os.path.join(folder, ".metadata")):
        legacy = os.path.isdir(folder) and any(name.startswith("mp_rank_") for name in os.listdir(folder))
        raise FileNotFoundError(
            f"{folder} has no .metadata: "
            + (
                f"it was written with --ckpt-format torch; {checkpointing.READS_TORCH}"
                if legacy
                else "not a torch.distributed.checkpoint folder"
            )
        )
    common = torch.load(os.path.join(folder, COMMON), map_location="cpu", weights_only=False)
    # tp and ep may change: a torch_dist checkpoint holds whole tensors, DTensor shards and the
    # hand-written tp's shards placed in them (tp_chunks), which DCP cuts for the loading layout, and
    # every expert under its global name (layers.<i>.mlp.experts.<e>), whichever ep rank holds it
    may_differ = ("tensor_model_parallel_size", "expert_model_parallel_size")
    checkpointing.check_args(common["args"], config.arguments, folder, may_differ=may_differ)
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata  # every key saved
    with_optimizer = any(key.startswith("optimizer.") for key in saved) and not config.no_load_optim
    distrib = any(key.startswith("optimizer.distrib.") for key in saved)
    if with_optimizer and distrib != isinstance(optimizer, DistributedOptimizer):
        raise ValueError(
            f"{folder}'s optimizer state was written {'with' if distrib else 'without'} "
            f"--use-distributed-optimizer: load it {'with' if distrib else 'without'} the flag, or "
            f"with --no-load-optim"
        )
    if with_optimizer and distrib:
        distrib_buckets.check(optimizer, saved, common["args"], folder)
    state_dict = _state_dict(
        model, optimizer, state, with_optimizer=with_optimizer
    )  # this run's, to be filled
    _check_vocabulary(state_dict["model"], saved, folder, common["args"], config.arguments)
    dcp.load(state_dict, checkpoint_id=folder)
    set_model_state_dict(model, state_dict["model"], options=OPTIONS)
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.main_from_params()
    if with_optimizer and distrib:
        distrib_buckets.load(optimizer, state_dict["optimizer"]["distrib"])
    elif with_optimizer:
        # the kernel choices are this run's, not the saver's: a checkpoint of an all-DTensor (FSDP2)
        # run saved fused=True, which a run mixing DTensor and plain parameters cannot take
        kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
        set_optimizer_state_dict(model, optimizer, state_dict["optimizer"], options=OPTIONS)
        for group, own in zip(optimizer.param_groups, kernels, strict=True):
            group.update(own)
    rngs, (tp_rank, pp_rank, _) = common["rng"], _coords(state)
    # new dp ranks: dp 0's; new tp ranks too: tp 0's default stream, but their own model-parallel
    # stream (tp 0's would repeat its attention-dropout masks)
    own = rngs.get(_coords(state)) or rngs.get((tp_rank, pp_rank, 0))
    if not config.no_load_rng:
        checkpointing.set_rng_state(own or rngs[(0, pp_rank, 0)], tracker=own is not None)
    return common["iteration"], common["consumed_samples"], None if config.no_load_optim else common["scaler"]
