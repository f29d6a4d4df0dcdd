"""The back ends' flags against each other and the layout: DeepSpeed, FSDP2, DTensor,
torch.compile and the checkpoint formats (part of :func:`~distlab.gpt.arguments.validation.validate_args`)."""

from __future__ import annotations

import os
import shutil

import torch

from distlab.gpt.arguments.groups import PretrainArgs
from distlab.gpt.deepspeed import config as deepspeed_config
from distlab.gpt.layout import Layout


def _deepspeed_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """--deepspeed: data parallelism only, fp32, and a config that obeys DeepSpeed's batch rule."""
    if not args.deepspeed:
        given = [f for f in ("deepspeed_config", "zero_stage") if getattr(args, f) is not None]
        flags = {"deepspeed_config": "--deepspeed_config", "zero_stage": "--zero-stage"}
        return [f"{flags[f]} was given without --deepspeed" for f in given]
    errors = []
    try:
        deepspeed_config.refuse_model_parallel(layout.tp, layout.pp)
    except ValueError as exc:
        errors.append(str(exc))
    if args.save or args.load:
        errors.append(
            "--deepspeed with --save/--load: DeepSpeed writes its own checkpoints (engine.save_checkpoint), "
            "which this course does not use; drop --save/--load"
        )
    if args.fp16 or args.bf16:
        errors.append(
            "--deepspeed runs in fp32 in this course: drop --fp16/--bf16 (the precision fixes are "
            "shown without DeepSpeed)"
        )
    if layout.batch_schedule:
        errors.append(
            "--deepspeed with a batch-size ramp: DeepSpeed's config fixes train_batch_size; drop "
            "--rampup-batch-size / --step-batch-size-schedule"
        )
    try:
        deepspeed_run_config(args, layout)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def _torch_compile_errors(args: PretrainArgs) -> list[str]:
    """--torch-compile on a CPU: inductor writes C++ and compiles it with $CXX (default g++) at run time."""
    compiler = os.environ.get("CXX", "g++")
    if not args.torch_compile or torch.cuda.is_available() or shutil.which(compiler):
        return []
    return [
        f"--torch-compile on a CPU needs a C++ compiler at run time and {compiler!r} is not on PATH: "
        f"install g++ (./lab setup does), set CXX to one, or leave --torch-compile out"
    ]


def _torch_fsdp2_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """--use-torch-fsdp2: data parallelism only (a 1-D mesh), fp32 or bf16, without --deepspeed,
    and saves only as --ckpt-format torch_dist (its shards need torch.distributed.checkpoint; a load
    reads the format it finds, and refuses the legacy one into DTensors)."""
    if not args.use_torch_fsdp2:
        given = ["--torch-fsdp2-cpu-offload"] if args.torch_fsdp2_cpu_offload else []
        if not args.torch_fsdp2_reshard_after_forward:
            given.append("--torch-fsdp2-reshard-after-forward False")
        return [f"{flag} was given without --use-torch-fsdp2" for flag in given]
    errors = []
    if layout.pp > 1 or (layout.tp > 1 and args.tensor_parallel_impl != "dtensor"):
        errors.append(
            f"--use-torch-fsdp2 shards over the data-parallel ranks (a 1-D DeviceMesh), next to DTensor's "
            f"tensor parallelism only: got --tensor-model-parallel-size {layout.tp} (--tensor-parallel-impl "
            f"{args.tensor_parallel_impl}) and --pipeline-model-parallel-size {layout.pp}; set pp to 1, and tp "
            f"to 1 or add --tensor-parallel-impl dtensor"
        )
    if args.deepspeed:
        errors.append(
            "--use-torch-fsdp2 and --deepspeed were both given: each shards the model over the "
            "data-parallel ranks (FSDP2, ZeRO): choose one"
        )
    if args.fp16:
        errors.append(
            "--use-torch-fsdp2 with --fp16: fp16 needs a loss scaler that unscales and checks the sharded "
            "gradients, which this back end does not have (Megatron-LM refuses it too): use --bf16 "
            "(MixedPrecisionPolicy: bf16 parameters, fp32 reduction)"
        )
    if args.save and args.ckpt_format == "torch":
        errors.append(
            f"--use-torch-fsdp2 with --save {args.save}: each rank holds DTensor shards of the parameters and "
            f"optimizer state, and --ckpt-format torch is one full copy written by data-parallel rank 0: "
            f"use --ckpt-format torch_dist (the default; torch.distributed.checkpoint: every rank writes "
            f"its shards)"
        )
    return errors


def _dtensor_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """--tensor-parallel-impl dtensor: tp (x FSDP2 over dp) on one mesh; no pipeline, no plain dp
    (DTensor gradients are reduced by FSDP2, not by the engine's flat all-reduce), no fp16 or
    DeepSpeed. --sequence-parallel is its SequenceParallel plan there (the layout checks tp > 1)."""
    errors = []
    if args.tensor_parallel_impl != "dtensor":
        return errors
    if layout.pp > 1:
        errors.append(
            f"--tensor-parallel-impl dtensor with --pipeline-model-parallel-size {layout.pp}: the DTensor "
            f"path has no pipeline stages (torch.distributed.pipelining is notebook 08's library): set it to 1"
        )
    if layout.dp > 1 and not args.use_torch_fsdp2:
        errors.append(
            f"--tensor-parallel-impl dtensor with data-parallel size {layout.dp} (world {layout.world_size} / "
            f"tp {layout.tp}): DTensor runs reduce their gradients over dp through FSDP2: add "
            f"--use-torch-fsdp2 (FSDP x TP on a 2-D mesh) or launch {layout.tp} processes"
        )
    if args.fp16 or args.deepspeed:
        given = "--fp16" if args.fp16 else "--deepspeed"
        errors.append(f"--tensor-parallel-impl dtensor with {given}: use fp32 or --bf16, without DeepSpeed")
    return errors


def _ckpt_format_errors(args: PretrainArgs) -> list[str]:
    """--async-save needs --ckpt-format torch_dist (as Megatron-LM), and --save."""
    errors = []
    if args.async_save and args.ckpt_format != "torch_dist":
        errors.append(
            f"--async-save with --ckpt-format {args.ckpt_format}: an asynchronous save stages the state "
            f"for torch.distributed.checkpoint's writer (Megatron-LM refuses it for the legacy format "
            f"too): use --ckpt-format torch_dist (the default)"
        )
    if args.async_save and args.save is None:
        errors.append("--async-save was given without --save DIR")
    return errors


def deepspeed_run_config(args: PretrainArgs, layout: Layout) -> dict:
    """The run's DeepSpeed config: ``--deepspeed_config`` (or none) filled and checked by the run."""
    return deepspeed_config.load_config(
        args.deepspeed_config or {},
        micro_batch_size=layout.micro_batch_size,
        accumulation_steps=layout.num_micro_batches,
        world_size=layout.world_size,
        zero_stage=args.zero_stage,
        clip_grad=args.clip_grad or None,
    )
