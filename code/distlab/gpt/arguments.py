"""Megatron-LM's command line for ``pretrain_gpt.py``, as one typed dataclass.

Every field of :class:`PretrainArgs` is a flag: ``num_layers`` is ``--num-layers``. Booleans
are Megatron's switches (``--fp16``), except the few the course passes as ``True|False``
(``--profile-execution True``). The dataclass is the single source of names, types, defaults and
help; :func:`parse_args` builds argparse from it and :func:`validate_args` checks everything
that can be checked before a process group or a tensor exists, naming the values and the fix,
and returns the run's one :class:`~distlab.gpt.layout.Layout` (parallel sizes and batch
arithmetic), which every part of the run then reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import typing
from dataclasses import dataclass, field

import torch

from distlab.distributed import pick_backend
from distlab.gpt.deepspeed import config as deepspeed_config
from distlab.gpt.layout import Layout, parse_step_schedule, rampup_schedule
from distlab.gpt.moe.moe_layer import config_errors, placement_errors
from distlab.gpt.pipeline_parallel.schedules import check_schedule
from distlab.gpt.training.fault_handling import SIGNALS
from distlab.gpt.transformer.recompute import granularity_of, recompute_errors


class ArgumentError(ValueError):
    """Bad or contradictory command-line arguments (raised before any compute)."""


def _f(default, help: str, **kw):  # noqa: A002 - argparse's own word
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class PretrainArgs:
    """Arguments of ``pretrain_gpt.py``; names and meanings follow Megatron-LM."""

    # --- model ---
    num_layers: int = _f(None, "transformer blocks (required)")
    hidden_size: int = _f(None, "model width H (required)")
    num_attention_heads: int = _f(None, "attention heads; H must be divisible by it (required)")
    seq_length: int = _f(None, "tokens per sample fed to the model (required)")
    max_position_embeddings: int = _f(None, "learned positions; >= --seq-length (default: seq length)")
    ffn_hidden_size: int = _f(None, "MLP width F (default 4H)")
    init_method_std: float = _f(0.02, "std of the normal initialisation; output layers use std/sqrt(2L)")
    hidden_dropout: float = _f(0.0, "dropout after attention and MLP (Megatron's default is 0.1)")
    attention_dropout: float = _f(0.0, "dropout on attention probabilities")
    make_vocab_size_divisible_by: int = _f(128, "pad the vocabulary to a multiple of this x tp")
    recompute_activations: bool = _f(
        False, "selective recomputation: the same as --recompute-granularity selective (as Megatron sets it)"
    )
    recompute_granularity: str = _f(
        None,
        "full: checkpoint whole blocks, keeping only their inputs (needs --recompute-method and "
        "--recompute-num-layers); selective: checkpoint the core attention softmax(QK^T/sqrt(d))V of "
        "every block, whose T x T scores are the 5as/h term of the activations",
        choices=["full", "selective"],
    )
    recompute_method: str = _f(
        None,
        "with --recompute-granularity full: uniform, groups of --recompute-num-layers consecutive blocks "
        "each keeping its input; block, only the first --recompute-num-layers blocks of each stage",
        choices=["uniform", "block"],
    )
    recompute_num_layers: int = _f(
        None,
        "with --recompute-granularity full: blocks per group (uniform) or per stage (block), 1 to L / pp "
        "(per model chunk with interleaving: 1 to L / (pp v))",
    )
    attention_backend: str = _f(
        "auto",
        "core attention: auto, flash and fused run PyTorch's scaled_dot_product_attention (its fused "
        "kernel keeps no T x T scores); unfused and local the explicit softmax(QK^T/sqrt(d))V, which stores them",
        choices=["flash", "fused", "unfused", "local", "auto"],
    )
    # --- data ---
    data_path: str = _f(None, "prefix of the .bin/.idx dataset, e.g. data/gpt/corpus_text_document")
    data_impl: str = _f("mmap", "indexed dataset implementation (only mmap)", choices=["mmap"])
    split: str = _f("969,30,1", "train,validation,test proportions of the documents")
    vocab_file: str = _f(None, "GPT-2-style vocab.json")
    merge_file: str = _f(None, "GPT-2-style merges.txt")
    tokenizer_type: str = _f("GPT2BPETokenizer", "tokenizer kind", choices=["GPT2BPETokenizer"])
    # --- batch and schedule ---
    micro_batch_size: int = _f(None, "samples per forward/backward on one rank (required)")
    global_batch_size: int = _f(None, "samples per optimizer step over all ranks (default micro x dp)")
    rampup_batch_size: list = _f(
        None,
        "START INCREMENT SAMPLES: the global batch starts at START and grows by INCREMENT in equal "
        "intervals until SAMPLES samples are consumed, then stays at --global-batch-size "
        "(Megatron's ramp, deprecated there for --step-batch-size-schedule)",
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
        type=int,
    )
    step_batch_size_schedule: str = _f(
        None,
        'global batch per threshold of consumed tokens, e.g. "0:16 2.4B:320 4.8B:624" (K, M, B, T '
        "suffixes); its last batch is the global batch size",
    )
    train_iters: int = _f(None, "optimizer steps to train for (required)")
    exit_duration_in_mins: float = _f(None, "save and stop after this many minutes")
    exit_signal_handler: bool = _f(
        False,
        "on --exit-signal, every rank finishes its iteration, agrees (MAX all-reduce), saves a checkpoint "
        "(with --save) and exits 0",
    )
    exit_signal: str = _f(
        "SIGTERM",
        "the signal --exit-signal-handler catches: SIGTERM is what Slurm sends at the time limit (then "
        "SIGKILL KillWait s later); #SBATCH --signal=USR1@N sends SIGUSR1 N s before it",
        choices=list(SIGNALS),
    )
    seed: int = _f(1234, "seed of initialisation, data shuffling and dropout")
    # --- optimizer ---
    optimizer: str = _f(
        "adam", "adam (decoupled weight decay, as Megatron) or sgd", choices=["adam", "adamw", "sgd"]
    )
    lr: float = _f(None, "peak learning rate (required)")
    min_lr: float = _f(0.0, "learning rate at the end of the decay")
    lr_decay_style: str = _f("linear", "decay shape", choices=["constant", "linear", "cosine"])
    lr_decay_iters: int = _f(None, "iterations of decay (default --train-iters)")
    lr_warmup_fraction: float = _f(None, "fraction of --lr-decay-iters spent in linear warm-up")
    lr_warmup_iters: int = _f(0, "warm-up iterations (when no fraction is given)")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    sgd_momentum: float = _f(0.9, "SGD momentum")
    weight_decay: float = _f(0.01, "decoupled weight decay (not on biases and LayerNorm)")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    # --- precision ---
    fp16: bool = _f(False, "float16 compute with dynamic loss scaling")
    bf16: bool = _f(False, "bfloat16 compute")
    initial_loss_scale: float = _f(2.0**32, "first loss scale with --fp16")
    min_loss_scale: float = _f(1.0, "smallest loss scale")
    loss_scale_window: int = _f(1000, "clean steps before the scale doubles")
    hysteresis: int = _f(2, "overflows tolerated before the scale halves")
    # --- memory ---
    device_memory_gib: float = _f(
        None,
        "cap each rank's CUDA memory at this many GiB (set_per_process_memory_fraction), so that "
        "a sweep runs out of memory at the same micro batch on any card; on CPU the job's --mem is the cap",
    )
    # --- DeepSpeed (Megatron-DeepSpeed's spelling) ---
    deepspeed: bool = _f(False, "train through DeepSpeed's engine (ZeRO); data parallelism only")
    deepspeed_config: str = _f(
        None, "DeepSpeed JSON config; its missing batch keys come from the run", flag="--deepspeed_config"
    )
    zero_stage: int = _f(None, "ZeRO stage 0-3, overriding the config's zero_optimization.stage")
    # --- PyTorch FSDP2 (Megatron-LM's --use-torch-fsdp2) ---
    use_torch_fsdp2: bool = _f(
        False,
        "shard parameters, gradients and optimizer state over the data-parallel ranks with PyTorch's "
        "fully_shard (FSDP2: ZeRO-3 with DTensor shards), each block then the root; data parallelism "
        "only, fp32 or --bf16",
    )
    torch_fsdp2_reshard_after_forward: bool = _f(
        True,
        "FSDP2's reshard_after_forward: free each block's gathered parameters after its forward and "
        "all-gather them again for its backward (True), or keep them until the backward (False: one "
        "all-gather instead of two); Megatron's --torch-fsdp2-no-reshard-after-forward sets False",
        tf=True,
    )
    torch_fsdp2_cpu_offload: bool = _f(
        False,
        "FSDP2's CPUOffloadPolicy: parameter shards, their gradients and the optimizer state on the CPU, "
        "where the optimizer steps; each all-gather copies a block's shards to the device",
    )
    # --- torch.compile (no Megatron-LM flag; PyTorch's name) ---
    torch_compile: bool = _f(
        False,
        "compile every transformer block with torch.compile (inductor; one graph for all blocks, "
        "compiled in the first iteration; needs a C compiler on a CPU); prints the first iteration's "
        "and the steady-state time at the end",
    )
    # --- parallelism ---
    tensor_model_parallel_size: int = _f(1, "ranks sharing each layer (tensor parallelism)")
    tensor_parallel_impl: str = _f(
        "megatron",
        "who splits the layers when tp > 1: this engine's Megatron-style layers (megatron) or PyTorch's "
        "DTensor parallelize_module plans on a DeviceMesh (dtensor; combines with --use-torch-fsdp2)",
        choices=["megatron", "dtensor"],
    )
    pipeline_model_parallel_size: int = _f(1, "pipeline stages")
    context_parallel_size: int = _f(
        1,
        "ranks sharing each sequence (context parallelism: ring attention); --seq-length must divide by 2x it",
    )
    sequence_parallel: bool = _f(
        False,
        "with tensor parallelism: LayerNorms, dropout and residual adds work on seq-length / tp positions "
        "per rank; the all-reduces become all-gathers and reduce-scatters (Korthikanti et al. 2022); by "
        "this engine's layers or, with --tensor-parallel-impl dtensor, by DTensor's SequenceParallel plan",
    )
    pipeline_schedule: str = _f("1f1b", "pipeline schedule when pp > 1", choices=["1f1b", "gpipe"])
    num_layers_per_virtual_pipeline_stage: int = _f(
        None, "layers per model chunk: each pipeline rank holds v = L / (pp x this) chunks (interleaved 1F1B)"
    )
    virtual_pipeline_model_parallel_size: int = _f(
        None,
        "v, model chunks per pipeline rank (interleaved 1F1B); Megatron-LM now spells it "
        "--num-virtual-stages-per-pipeline-rank, also accepted",
    )
    pipeline_timeline: str = _f(None, "pp > 1: write the last step's F/B times per stage as JSON")
    # --- mixture of experts (Megatron-LM's --num-experts and --moe-*) ---
    num_experts: int = _f(
        None, "experts E per MoE layer: every block's MLP becomes a router and E experts (None: dense)"
    )
    expert_model_parallel_size: int = _f(
        1,
        "ep: the data-parallel ranks over which each layer's experts are split (E / ep per rank); divides dp",
    )
    moe_router_topk: int = _f(2, "k: experts per token (softmax over the k largest router logits)")
    moe_aux_loss_coeff: float = _f(
        0.0,
        "weight of the Switch/GShard load-balancing loss E sum_i f_i P_i added to the lm loss (1e-2 is a start)",
    )
    moe_expert_capacity_factor: float = _f(
        None,
        "c: each expert keeps at most ceil(k N / E x c) of a micro-batch's N tokens (those of highest router "
        "probability) and drops the rest; None (or negative): dropless",
    )
    moe_token_dispatcher_type: str = _f(
        "allgather",
        "how tokens reach experts on other ranks: alltoall (all_to_all_single of uneven splits, the one this "
        "engine implements; needed when --expert-model-parallel-size > 1); allgather is Megatron's default",
        choices=["allgather", "alltoall"],
    )
    overlap_grad_reduce: bool = _f(
        False,
        "start each bucket's data-parallel all-reduce during the last micro-batch's backward, as soon as "
        "its last gradient is accumulated; the step waits for all before the optimizer (pp 1 only here)",
    )
    ddp_bucket_size: int = _f(
        None,
        "elements per gradient bucket (buckets fill in the reverse of the parameters' order); default "
        "Megatron's max(40000000, 1000000 x dp)",
    )
    distributed_backend: str = _f(None, "nccl or gloo (default: from the hardware)", choices=["nccl", "gloo"])
    distributed_timeout_minutes: float = _f(5.0, "collectives fail after waiting this long")
    local_rank: int = _f(None, "set by the legacy torch.distributed.launch; ignored (LOCAL_RANK wins)")
    # --- logging, evaluation, checkpoints ---
    log_interval: int = _f(100, "iterations between log lines")
    eval_interval: int = _f(1000, "iterations between validation runs")
    eval_iters: int = _f(100, "global batches per validation run")
    tensorboard_dir: str = _f(None, "write TensorBoard scalars here")
    tensorboard_queue_size: int = _f(1000, "events buffered before TensorBoard flushes")
    log_timers_to_tensorboard: bool = _f(False, "also write timers")
    log_batch_size_to_tensorboard: bool = _f(False, "also write the batch size")
    log_validation_ppl_to_tensorboard: bool = _f(False, "also write validation perplexity")
    save: str = _f(None, "checkpoint directory to write")
    load: str = _f(None, "checkpoint directory to resume from")
    save_interval: int = _f(None, "iterations between checkpoints (and one at the end)")
    ckpt_format: str = _f(
        "torch",
        "torch: one file per tensor/pipeline rank, written by data-parallel rank 0 (Megatron's legacy "
        "format); torch_dist: torch.distributed.checkpoint, every rank writes its shards, loadable by "
        "another number of data-parallel ranks, with or without FSDP2 (Megatron-LM's default)",
        choices=["torch", "torch_dist"],
    )
    async_save: bool = _f(
        False,
        "with --ckpt-format torch_dist: copy the state to CPU memory, then write it in a thread while "
        "training goes on (dcp.async_save); the next save and the end of training wait for it",
    )
    profile_execution: bool = _f(
        False, "torch.profiler trace of --profile-step-start+1..end (True|False)", tf=True
    )
    profile_name: str = _f("profile", "run name of the trace under --tensorboard-dir")
    profile_ranks: str = _f("0", "global ranks that write a trace, e.g. 0,2: one per pipeline stage")
    profile_step_start: int = _f(1, "the profiler warms up on this iteration and traces the next ones")
    profile_step_end: int = _f(3, "last traced iteration (traced: start+1 .. end)")


def _str2bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """argparse with one flag per field, spelt as Megatron spells it."""
    parser = argparse.ArgumentParser(description="Megatron-style GPT pretraining", allow_abbrev=False)
    hints = typing.get_type_hints(PretrainArgs)
    for f in dataclasses.fields(PretrainArgs):
        meta = dict(f.metadata)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        help_ = meta.pop("help")
        tf = meta.pop("tf", False)
        kind = hints[f.name]
        if kind is bool and tf:
            parser.add_argument(flag, type=_str2bool, default=f.default, metavar="True|False", help=help_)
        elif kind is bool:
            parser.add_argument(flag, action="store_true", help=help_)
        else:
            meta.setdefault("type", kind)
            parser.add_argument(flag, default=f.default, help=help_, **meta)
    parser.add_argument("--local_rank", type=int, dest="local_rank", help=argparse.SUPPRESS)
    parser.add_argument(  # Megatron-LM's current name for the same field
        "--num-virtual-stages-per-pipeline-rank", type=int, dest="virtual_pipeline_model_parallel_size",
        help="the same as --virtual-pipeline-model-parallel-size",
    )  # fmt: skip
    parser.add_argument(  # Megatron-LM's switch for the same field
        "--torch-fsdp2-no-reshard-after-forward", action="store_false", dest="torch_fsdp2_reshard_after_forward",
        help="the same as --torch-fsdp2-reshard-after-forward False",
    )  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> PretrainArgs:
    """Parse a command line; unknown flags exit with argparse's message naming them."""
    ns = build_parser().parse_args(argv)
    return PretrainArgs(**vars(ns))


def parse_split(split: str) -> list[float]:
    """``"949,50,1"`` -> ``[0.949, 0.05, 0.001]`` (missing parts are 0)."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--split {split!r} must be numbers separated by commas, e.g. 949,50,1") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"--split {split!r} must be 1 to 3 non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def validate_args(args: PretrainArgs, world_size: int) -> Layout:
    """Check arguments against each other and the world size; fill defaults; return the layout.

    Raises ``ValueError`` listing every problem found, before any compute.
    """
    required = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                "train_iters", "lr")  # fmt: skip
    missing = [f"--{name.replace('_', '-')} is required" for name in required if getattr(args, name) is None]
    if missing:
        raise ValueError("; ".join(missing))
    layout = build_layout(args, world_size)
    layout.validate_model(
        num_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        hidden_size=args.hidden_size,
        seq_length=args.seq_length,
    )
    args.global_batch_size = layout.global_batch_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    errors = [
        *_model_and_optimizer_errors(args),
        *_file_errors(args),
        *_profile_errors(args, world_size),
        *_deepspeed_errors(args, layout),
        *_torch_fsdp2_errors(args, layout),
        *_torch_compile_errors(args),
        *_dtensor_errors(args, layout),
        *_ckpt_format_errors(args, layout),
        *_recompute_errors(args, layout),
        *_moe_errors(args, layout),
        *_context_parallel_errors(args, layout),
        *_interleaving_errors(args, layout),
        *_grad_reduce_errors(args, layout),
    ]
    if errors:
        raise ValueError("invalid arguments: " + "; ".join(errors))
    return layout


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
    if args.expert_model_parallel_size > 1 and args.num_experts is None:
        raise ValueError(
            f"--expert-model-parallel-size {args.expert_model_parallel_size} needs --num-experts: "
            f"expert parallelism splits the experts of a mixture-of-experts MLP"
        )
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
        sequence_parallel=args.sequence_parallel,
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
    if args.hidden_size % args.num_attention_heads:
        errors.append(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}: head size must be an integer"
        )
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
        if getattr(args, name) < 1:
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
    """The dataset, the tokenizer files, the checkpoint folders and the exit signal that saves."""
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
    if args.data_path is None:
        errors.append("--data-path is required: run code/preprocess_data.py first (see its docstring)")
    elif not (os.path.exists(args.data_path + ".bin") and os.path.exists(args.data_path + ".idx")):
        errors.append(
            f"--data-path {args.data_path}: no {args.data_path}.bin/.idx; give the prefix "
            f"written by preprocess_data.py (it ends in _text_document)"
        )
    for name in ("vocab_file", "merge_file"):
        path = getattr(args, name)
        if path is None or not os.path.exists(path):
            errors.append(f"--{name.replace('_', '-')} {path} does not exist: run code/train_tokenizer.py")
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
    try:
        bad = [r for r in profile_ranks(args) if not 0 <= r < world_size]
        if bad:
            errors.append(f"--profile-ranks {args.profile_ranks}: ranks {bad} not in world size {world_size}")
    except ValueError:
        errors.append(f"--profile-ranks {args.profile_ranks}: expected comma-separated ranks, e.g. 0,2")
    return errors


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
    and checkpoints only as --ckpt-format torch_dist (its shards need torch.distributed.checkpoint)."""
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
    if (args.save or args.load) and args.ckpt_format == "torch":
        given = " and ".join(f"--{n} {getattr(args, n)}" for n in ("save", "load") if getattr(args, n))
        errors.append(
            f"--use-torch-fsdp2 with {given}: each rank holds DTensor shards of the parameters and "
            f"optimizer state, and --ckpt-format torch is one full copy written by data-parallel rank 0: "
            f"add --ckpt-format torch_dist (torch.distributed.checkpoint: every rank writes its shards)"
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


def _ckpt_format_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """--async-save needs --ckpt-format torch_dist (as Megatron-LM); torch_dist has no tensor parallelism."""
    errors = []
    if args.async_save and args.ckpt_format != "torch_dist":
        errors.append(
            f"--async-save with --ckpt-format {args.ckpt_format}: an asynchronous save stages the state "
            f"for torch.distributed.checkpoint's writer (Megatron-LM refuses it for the legacy format "
            f"too): add --ckpt-format torch_dist"
        )
    if args.async_save and args.save is None:
        errors.append("--async-save was given without --save DIR")
    dtensor = args.tensor_parallel_impl == "dtensor"
    if args.ckpt_format == "torch_dist" and layout.tp > 1 and not dtensor and (args.save or args.load):
        errors.append(
            f"--ckpt-format torch_dist with --tensor-model-parallel-size {layout.tp}: this engine's "
            f"tensor-parallel shards are plain tensors of the same name on every tp rank, which "
            f"torch.distributed.checkpoint would take for copies of one tensor: use --ckpt-format torch, "
            f"or --tensor-parallel-impl dtensor (DTensor shards: DCP knows where each lies)"
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


def _context_parallel_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """--context-parallel-size: this engine's own back end, no attention dropout, the legacy checkpoints."""
    if layout.cp == 1:
        return []
    flag = f"--context-parallel-size {layout.cp}"
    errors = [
        f"{flag} with {name}: {why}"
        for name, given, why in (
            ("--deepspeed", args.deepspeed, "ZeRO shards over the data-parallel ranks only; drop one"),
            ("--use-torch-fsdp2", args.use_torch_fsdp2, "its mesh is the data-parallel ranks only; drop one"),
            ("--tensor-parallel-impl dtensor", args.tensor_parallel_impl == "dtensor",
             "its DeviceMesh has no cp dimension here; use --tensor-parallel-impl megatron"),
            (f"--attention-dropout {args.attention_dropout}", args.attention_dropout > 0,
             "ring attention has no dropout; set it to 0"),
            ("--ckpt-format torch_dist", args.ckpt_format == "torch_dist" and bool(args.save or args.load),
             "cp ranks hold the same weights under the same names; use --ckpt-format torch"),
            ("--sequence-parallel", args.sequence_parallel,
             "not combined with ring attention in this engine; drop one"),
        )
        if given
    ]  # fmt: skip
    return errors


def _interleaving_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """v > 1 (its sizes are checked by the layout): the interleaved schedule is a 1F1B, with a
    whole sequence per rank."""
    try:
        check_schedule(args.pipeline_schedule, layout.vp)
    except ValueError as e:
        return [str(e)]
    if layout.vp > 1 and args.sequence_parallel:
        return [
            f"--sequence-parallel with an interleaved pipeline (v = {layout.vp}): not combined in this "
            f"engine; drop the virtual-pipeline flag or --sequence-parallel"
        ]
    if layout.vp > 1 and layout.cp > 1:
        return [
            f"--context-parallel-size {layout.cp} with an interleaved pipeline (v = {layout.vp}): not "
            f"combined in this engine; drop the virtual-pipeline flag or set --context-parallel-size 1"
        ]
    return []


def _grad_reduce_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """--ddp-bucket-size > 0; --overlap-grad-reduce is this engine's own (LocalBackend), with pp 1
    (its pipeline schedules do not tell the buckets which backward is the last micro-batch's).
    Without dp > 1 it is accepted and does nothing, as in Megatron-LM."""
    errors = []
    if args.ddp_bucket_size is not None and args.ddp_bucket_size <= 0:
        errors.append(
            f"--ddp-bucket-size {args.ddp_bucket_size}: a bucket holds a positive number of gradient "
            f"elements; give e.g. 1000000, or leave it out for Megatron's default"
        )
    if not args.overlap_grad_reduce:
        return errors
    if layout.pp > 1:
        errors.append(
            f"--overlap-grad-reduce with --pipeline-model-parallel-size {layout.pp}: this engine overlaps "
            f"the gradient all-reduce only without pipeline parallelism; set pp 1 or drop the flag"
        )
    for flag, given in (("--deepspeed", args.deepspeed), ("--use-torch-fsdp2", args.use_torch_fsdp2)):
        if given:
            errors.append(
                f"--overlap-grad-reduce with {flag}: that back end reduces the gradients in its own hooks "
                f"(overlapped already); drop --overlap-grad-reduce"
            )
    return errors


def profile_ranks(args: PretrainArgs) -> set[int]:
    """The global ranks named by ``--profile-ranks`` ("0,2" -> {0, 2})."""
    return {int(r) for r in args.profile_ranks.split(",") if r.strip()}


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


def _moe_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """The MoE flags against each other and the layout (ep dividing dp is the layout's own check).
    Refused, as not built here: MoE with tp or pp > 1, with full recomputation, DeepSpeed or
    FSDP2, and checkpoints of experts split over ep ranks."""
    if args.num_experts is None:
        if args.moe_expert_capacity_factor is not None:
            return [
                f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor} was given without --num-experts"
            ]
        return []
    errors = config_errors(args.num_experts, args.moe_router_topk, args.moe_expert_capacity_factor)
    errors += placement_errors(args.num_experts, layout.ep)
    if layout.ep > 1 and args.moe_token_dispatcher_type != "alltoall":
        errors.append(
            f"--expert-model-parallel-size {layout.ep} with --moe-token-dispatcher-type "
            f"{args.moe_token_dispatcher_type}: this engine moves tokens between expert ranks with "
            f"all-to-all only; add --moe-token-dispatcher-type alltoall"
        )
    if layout.tp > 1 or layout.pp > 1:
        errors.append(
            f"--num-experts with --tensor-model-parallel-size {layout.tp} and --pipeline-model-parallel-size "
            f"{layout.pp}: this engine's MoE runs with tp = pp = 1 only (experts split over data-parallel "
            f"ranks; the aux loss joins the loss on the one stage); set both to 1"
        )
    if layout.cp > 1:
        errors.append(
            f"--num-experts with --context-parallel-size {layout.cp}: this engine's router counts the "
            f"tokens per expert of one sequence shard only (Megatron sums them over the cp group); "
            f"set --context-parallel-size 1"
        )
    if args.recompute_granularity == "full":
        errors.append(
            "--num-experts with --recompute-granularity full: the router's aux loss would be computed "
            "inside the checkpointed blocks; use --recompute-activations (selective) or none"
        )
    if args.deepspeed or args.use_torch_fsdp2:
        errors.append(
            "--num-experts with --deepspeed / --use-torch-fsdp2: those back ends average every gradient "
            "over all data-parallel ranks; MoE runs on this engine's own back end: drop them"
        )
    if layout.ep > 1 and (args.save or args.load):
        errors.append(
            f"--save/--load with --expert-model-parallel-size {layout.ep}: each ep rank holds different "
            f"experts and the checkpoint formats here write one copy per model-parallel rank; drop "
            f"--save/--load or use --expert-model-parallel-size 1"
        )
    return errors
