"""Megatron's ``validate_args``: every flag against the others and the world size, before any
process group or tensor exists, each problem named with its values and its fix; the result is the
run's one :class:`~distlab.gpt.layout.Layout` (parallel sizes and batch arithmetic), which every
part of the run then reads."""

from __future__ import annotations

import copy
import os

import torch

from distlab.distributed import pick_backend
from distlab.gpt.arguments.architecture import architecture_args_errors, fill_architecture_defaults
from distlab.gpt.arguments.backends import (
    _ckpt_format_errors,
    _deepspeed_errors,
    _dtensor_errors,
    _torch_compile_errors,
    _torch_fsdp2_errors,
)
from distlab.gpt.arguments.data_checks import data_errors, tokenizer_errors
from distlab.gpt.arguments.distrib_optimizer_rules import distributed_optimizer_errors
from distlab.gpt.arguments.groups import PretrainArgs
from distlab.gpt.arguments.implementations import apply_profile_flags, implementation_errors
from distlab.gpt.arguments.parser import as_list, parse_split
from distlab.gpt.arguments.refused import refused_errors
from distlab.gpt.arguments.samples import decoupled_lr_errors, length_errors, train_iters_from_samples
from distlab.gpt.layout import Layout, parse_step_schedule, rampup_schedule
from distlab.gpt.model_layout import ModelShape, model_layout_errors
from distlab.gpt.pipeline_parallel.schedules import check_schedule
from distlab.gpt.transformer.moe.moe_layer import config_errors
from distlab.gpt.transformer.moe.router import LOAD_BALANCING_TYPES
from distlab.gpt.transformer.recompute import granularity_of, recompute_errors


def validate_args(args: PretrainArgs, world_size: int) -> Layout:
    """Check arguments against each other and the world size; fill defaults; return the layout.

    Raises ``ValueError`` listing every problem found, before any compute.
    """
    required = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr")
    missing = [f"--{name.replace('_', '-')} is required" for name in required if getattr(args, name) is None]
    missing += length_errors(args)  # --train-iters or --train-samples, and their schedule flags
    if missing:
        raise ValueError("; ".join(missing))
    layout = build_layout(args, world_size)
    if args.train_samples is not None:
        args.train_iters = train_iters_from_samples(
            args, layout.global_batch_size, bool(layout.batch_schedule)
        )
    apply_profile_flags(args)
    args.global_batch_size = layout.global_batch_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.lr_decay_iters is None and args.train_samples is None:
        args.lr_decay_iters = args.train_iters
    fill_architecture_defaults(args)
    if args.split is None:  # Megatron's legacy default, which it fills in with a warning
        args.split = "969,30,1"
    errors = [
        *model_layout_errors(model_shape(args), layout),
        *architecture_args_errors(args, layout),
        *refused_errors(args, torch.cuda.is_available()),
        *data_errors(args),
        *tokenizer_errors(args),
        *implementation_errors(args),
        *decoupled_lr_errors(args),
        *_model_and_optimizer_errors(args),
        *_file_errors(args),
        *_profile_errors(args, world_size),
        *_deepspeed_errors(args, layout),
        *_torch_fsdp2_errors(args, layout),
        *_torch_compile_errors(args),
        *_dtensor_errors(args, layout),
        *_ckpt_format_errors(args),
        *_recompute_errors(args, layout),
        *_moe_errors(args, layout),
        *_context_parallel_errors(args, layout),
        *_interleaving_errors(args, layout),
        *_grad_reduce_errors(args),
        *distributed_optimizer_errors(args, layout),
    ]
    if errors:
        raise ValueError("invalid arguments: " + "; ".join(errors))
    return layout


def engine_layout(args: PretrainArgs, world_size: int) -> Layout | str:
    """The layout :func:`validate_args` builds for a copy of ``args`` on ``world_size`` ranks, or
    its refusal: what planners and exercise graders ask, so that they propose only what the engine
    runs. A plan is of the model, layout and batch flags: where ``args`` leave out what a run also
    needs (its length, learning rate, data, tokenizer files), one iteration at lr 1e-4 on mock data
    stands in, tokenized by a NullTokenizer of ``--vocab-size`` (GPT-2's 50,257 if not given: the
    vocabulary is padded to a multiple of tp, so its size refuses no layout)."""
    run = copy.deepcopy(args)
    if run.train_iters is None and run.train_samples is None:
        run.train_iters = 1
    if run.lr is None:
        run.lr = 1e-4
    if run.data_path is None and not run.mock_data:
        run.mock_data = True
    if run.tokenizer_type in (None, "GPT2BPETokenizer") and not (
        run.vocab_file and os.path.exists(run.vocab_file)
    ):
        run.tokenizer_type, run.vocab_size = "NullTokenizer", run.vocab_size or 50257
    try:
        return validate_args(run, world_size)
    except ValueError as refused:
        return str(refused)


def build_layout(args: PretrainArgs, world_size: int) -> Layout:
    """The parallel sizes and the batch arithmetic (a ramp's steps included), checked."""
    schedule: tuple = ()
    if args.rampup_batch_size is not None and args.step_batch_size_schedule is not None:
        raise ValueError("--rampup-batch-size and --step-batch-size-schedule were both given: choose one")
    if args.step_batch_size_schedule is not None:
        schedule = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
        final = schedule[-1][1]
        if args.global_batch_size not in (None, final):
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} differs from the last batch {final} of "
                f'--step-batch-size-schedule "{args.step_batch_size_schedule}": drop one or make them agree'
            )
        args.global_batch_size = final
    elif args.rampup_batch_size is not None:
        if args.global_batch_size is None:
            raise ValueError("--rampup-batch-size needs --global-batch-size: the size the ramp ends at")
        schedule = rampup_schedule(*args.rampup_batch_size, args.global_batch_size)
    args.virtual_pipeline_model_parallel_size = virtual_stages(args)
    return Layout(
        world_size,
        tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size,
        cp=args.context_parallel_size,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        batch_schedule=schedule,
        vp=args.virtual_pipeline_model_parallel_size,
        # Megatron turns --sequence-parallel off without tensor parallelism (and says so at start-up)
        sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1,
    )


def model_shape(args: PretrainArgs) -> ModelShape:
    """The sizes ``model_layout``'s rules read, from the arguments (the vocabulary is checked once
    padded, by the model; the query groups only with ``--group-query-attention``)."""
    return ModelShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        num_experts=args.num_experts,
        attention_dropout=args.attention_dropout,
    )


def virtual_stages(args: PretrainArgs) -> int:
    """v, model chunks per pipeline rank, from either of Megatron's two flags (1: no interleaving)."""
    per_chunk, v = args.num_layers_per_virtual_pipeline_stage, args.virtual_pipeline_model_parallel_size
    if per_chunk is not None and v is not None:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {per_chunk} and --virtual-pipeline-model-parallel-size "
            f"{v} were both given: choose one"
        )
    if per_chunk is None:
        return 1 if v is None else v
    L, pp = args.num_layers, args.pipeline_model_parallel_size
    if per_chunk < 1 or L % pp or (L // pp) % per_chunk:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {per_chunk} must divide the --num-layers {L} / "
            f"--pipeline-model-parallel-size {pp} layers of a pipeline rank"
        )
    return L // pp // per_chunk


def _model_and_optimizer_errors(args: PretrainArgs) -> list[str]:
    errors = []
    if args.seq_length > args.max_position_embeddings:
        errors.append(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}: raise the latter or shorten the sequence"
        )
    if args.pipeline_timeline and args.pipeline_model_parallel_size == 1:
        errors.append(
            f"--pipeline-timeline {args.pipeline_timeline} needs --pipeline-model-parallel-size > 1, "
            f"got {args.pipeline_model_parallel_size}"
        )
    if args.fp16 and args.bf16:
        errors.append("--fp16 and --bf16 were both given: choose one precision")
    if args.fp32_residual_connection and not (args.fp16 or args.bf16):
        errors.append(  # Megatron's own assertion
            "--fp32-residual-connection without --bf16 or --fp16: an fp32 run's residual stream is fp32 "
            "already (Megatron: 'residual connection in fp32 only supported when using fp16 or bf16'): "
            "add --bf16 or --fp16, or drop --fp32-residual-connection"
        )
    if args.min_lr > args.lr:
        errors.append(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        errors.append(
            f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-iters "
            f"{args.lr_warmup_iters} were both given: choose one"
        )
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        errors.append(f"--lr-warmup-fraction {args.lr_warmup_fraction} must be within [0, 1]")
    for name in ("log_interval", "eval_interval"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.eval_iters < 0:
        errors.append(f"--eval-iters {args.eval_iters} must be >= 0")
    if args.device_memory_gib is not None and args.device_memory_gib <= 0:
        errors.append(f"--device-memory-gib {args.device_memory_gib} must be > 0")
    try:
        pick_backend(args.distributed_backend)
    except ValueError as exc:
        errors.append(f"--distributed-backend {args.distributed_backend}: {exc}")
    try:
        parse_split(args.split)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def _file_errors(args: PretrainArgs) -> list[str]:
    """The checkpoint folders and the exit signal that saves (the data and tokenizer files:
    ``data_checks.py``)."""
    errors = []
    if args.exit_signal != "SIGTERM" and not args.exit_signal_handler:
        errors.append(
            f"--exit-signal {args.exit_signal} was given without --exit-signal-handler: the signal would "
            f"end the run by its default action instead of a checkpoint and a clean exit"
        )
    if args.save_interval is not None and args.save is None:
        errors.append(f"--save-interval {args.save_interval} was given without --save DIR")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        errors.append(f"--load {args.load} is a file, not a checkpoint directory")
    return errors


def _profile_errors(args: PretrainArgs, world_size: int) -> list[str]:
    """--profile-step-start/end within the run; --profile-ranks within the world."""
    errors = []
    start, end = args.profile_step_start, args.profile_step_end
    if args.profile_execution and not 1 <= start < end <= args.train_iters:
        errors.append(
            f"--profile-step-start {start} and --profile-step-end {end} need 1 <= start < end <= "
            f"--train-iters {args.train_iters} (warm-up on iteration start, traced start+1..end): "
            f"train longer or trace fewer steps"
        )
    bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
    if bad:
        errors.append(
            f"--profile-ranks {' '.join(map(str, args.profile_ranks))}: ranks {bad} not in world size "
            f"{world_size}: name ranks 0 to {world_size - 1}, or none to trace every rank"
        )
    return errors


def _recompute_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """Megatron-LM's recomputation rules (``recompute.recompute_errors``), where
    ``--recompute-activations`` is ``--recompute-granularity selective``."""
    if args.recompute_activations and args.recompute_granularity == "full":
        return [
            "--recompute-activations (selective recomputation) and --recompute-granularity full "
            "were both given: choose one"
        ]
    return recompute_errors(
        granularity_of(args.recompute_activations, args.recompute_granularity),
        args.recompute_method,
        args.recompute_num_layers,
        args.num_layers // (layout.pp * layout.vp),
    )


def _moe_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """The MoE flags against each other and the layout (ep dividing dp x cp is the layout's own
    check), as megatron-core's ``TransformerConfig`` and ``parallel_state`` check them. Refused, as
    not built here: expert tensor parallelism other than etp = tp, the flex dispatcher, load
    balancing other than aux_loss or none, full recomputation, DeepSpeed, FSDP2 and DTensor."""
    if args.num_experts is None:
        if args.moe_expert_capacity_factor is not None:
            return [
                f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor} was given without --num-experts"
            ]
        return []
    errors = config_errors(args.num_experts, args.moe_router_topk, args.moe_expert_capacity_factor)
    errors += _load_balancing_errors(args)
    etp = args.expert_tensor_parallel_size
    if etp is not None and etp != layout.tp:
        errors.append(
            f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {layout.tp}: this engine "
            f"splits each expert over the tp ranks themselves (megatron-core's default, etp = tp); leave "
            f"the flag out or set it to {layout.tp}"
        )
    if args.moe_token_dispatcher_type == "flex":
        errors.append(
            "--moe-token-dispatcher-type flex: Megatron's flex dispatcher runs DeepEP or HybridEP kernels "
            "(CUDA, NVLink/RDMA); use allgather (the default) or alltoall"
        )
    if args.recompute_granularity == "full":
        errors.append(
            "--num-experts with --recompute-granularity full: the router's statistics would be counted "
            "again when the blocks are recomputed; use --recompute-activations (selective) or none"
        )
    for flag, given in (("--deepspeed", args.deepspeed), ("--use-torch-fsdp2", args.use_torch_fsdp2),
                        ("--tensor-parallel-impl dtensor", args.tensor_parallel_impl == "dtensor")):  # fmt: skip
        if given:
            errors.append(
                f"--num-experts with {flag}: that back end averages every gradient over all data-parallel "
                f"ranks and has no expert groups; MoE runs on this engine's own back end: drop {flag}"
            )
    return errors


def _load_balancing_errors(args: PretrainArgs) -> list[str]:
    """One ``--moe-router-load-balancing-type`` of those built, one coefficient per type (Megatron's rule)."""
    types, coeffs = as_list(args.moe_router_load_balancing_type), as_list(args.moe_aux_loss_coeff)
    errors = []
    if len(types) > 1:
        errors.append(
            f"--moe-router-load-balancing-type {' '.join(types)}: combining several balancing losses is "
            f"not built here; give one (aux_loss)"
        )
    for kind in types:
        if why := LOAD_BALANCING_TYPES.get(kind):
            errors.append(
                f"--moe-router-load-balancing-type {kind}: {why}; use aux_loss (the default) or none"
            )
    if len(coeffs) != len(types):
        errors.append(
            f"--moe-aux-loss-coeff {' '.join(map(str, coeffs))}: one coefficient per "
            f"--moe-router-load-balancing-type ({len(types)} given), as Megatron requires"
        )
    return errors


def _context_parallel_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """--context-parallel-size: this engine's own back end, no attention dropout."""
    if layout.cp == 1:
        return []
    flag = f"--context-parallel-size {layout.cp}"
    errors = [
        f"{flag} with {name}: {why}" if name else why
        for name, given, why in (
            ("--deepspeed", args.deepspeed, "ZeRO shards over the data-parallel ranks only; drop one"),
            ("--use-torch-fsdp2", args.use_torch_fsdp2, "its mesh is the data-parallel ranks only; drop one"),
            ("--tensor-parallel-impl dtensor", args.tensor_parallel_impl == "dtensor",
             "its DeviceMesh has no cp dimension here; use --tensor-parallel-impl megatron"),
        )
        if given and why
    ]  # fmt: skip
    return errors


def _interleaving_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """v > 1 (its sizes are checked by the layout): the interleaved schedule is a 1F1B. With context
    parallelism each chunk's ring attention runs over the cp group, whose ranks are at the same
    place of the same schedule; with --sequence-parallel every chunk sends its (b, T / tp, H) slice,
    as the plain pipeline does (``build.build_forward_backward``'s shape)."""
    try:
        check_schedule(args.pipeline_schedule, layout.vp)
    except ValueError as e:
        return [str(e)]
    return []


def _grad_reduce_errors(args: PretrainArgs) -> list[str]:
    """--ddp-bucket-size > 0; --overlap-grad-reduce is this engine's own (LocalBackend), with every
    schedule (each chunk's last backward starts its buckets: ``interfaces.GradSyncFn``). Without
    dp > 1 it is accepted and does nothing, as in Megatron-LM."""
    errors = []
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        errors.append(
            f"--ddp-bucket-size {args.ddp_bucket_size}: a bucket holds a positive number of gradient "
            f"elements; give e.g. 1000000, or leave it out for Megatron's default"
        )
    if not args.overlap_grad_reduce:
        return errors
    for flag, given in (("--deepspeed", args.deepspeed), ("--use-torch-fsdp2", args.use_torch_fsdp2)):
        if given:
            errors.append(
                f"--overlap-grad-reduce with {flag}: that back end reduces the gradients in its own hooks "
                f"(overlapped already); drop --overlap-grad-reduce"
            )
    return errors
