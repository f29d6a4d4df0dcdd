"""Megatron's groups of training, learning-rate, checkpointing, mixed-precision, validation and
logging flags (``_add_training_args`` ...), one dataclass each; ``groups.py`` joins them into
``PretrainArgs``."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.gpt.arguments.fields import _f
from distlab.gpt.training.fault_handling import SIGNALS


@dataclass
class TrainingArgs:
    """Batches, recomputation, the optimizer, when to stop, the profiler, torch.compile (Megatron's
    ``_add_training_args``)."""

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
    optimizer: str = _f(
        "adam", "adam (decoupled weight decay, as Megatron) or sgd", choices=["adam", "adamw", "sgd"]
    )
    device_memory_gib: float = _f(
        None,
        "cap each rank's CUDA memory at this many GiB (set_per_process_memory_fraction), so that "
        "a sweep runs out of memory at the same micro batch on any card; on CPU the job's --mem is the cap",
    )
    torch_compile: bool = _f(
        False,
        "compile every transformer block with torch.compile (inductor; one graph for all blocks, "
        "compiled in the first iteration; needs a C compiler on a CPU); prints the first iteration's "
        "and the steady-state time at the end",
    )
    profile_execution: bool = _f(
        False, "torch.profiler trace of --profile-step-start+1..end (True|False)", tf=True
    )
    profile_name: str = _f("profile", "run name of the trace under --tensorboard-dir")
    profile_ranks: list[int] = _f(
        [], "global ranks that write a trace, e.g. 0 2: one per pipeline stage (none given: every rank)",
        nargs="+", type=int,
    )  # fmt: skip
    profile_step_start: int = _f(10, "the profiler warms up on this iteration and traces the next ones")
    profile_step_end: int = _f(12, "last traced iteration (traced: start+1 .. end)")
    train_samples: int = _f(
        None,
        "samples to train over, instead of --train-iters: iterations = train samples // global batch "
        "(the LR schedule then counts samples: --lr-decay-samples, --lr-warmup-samples)",
    )
    manual_gc: bool = _f(
        False,
        "turn Python's threshold garbage collector off (gc.disable) and collect at fixed points only: "
        "before training, every --manual-gc-interval iterations, around each validation",
    )
    manual_gc_interval: int = _f(0, "with --manual-gc: gc.collect() every this many iterations (0: never)")
    manual_gc_eval: bool = _f(
        True,
        "with --manual-gc: collect before and after each validation (--no-manual-gc-eval: not)",
        flag="--no-manual-gc-eval",
        action="store_false",
    )
    empty_unused_memory_level: int = _f(
        0,
        "torch.cuda.empty_cache() after each forward/backward (1) and also after the optimizer step (2), "
        "returning the caching allocator's free blocks; 0: never (a CPU has no such cache)",
        choices=[0, 1, 2],
    )
    calculate_per_token_loss: bool = _f(
        False,
        "the loss of a global batch is its summed token losses over its number of (unmasked) tokens, "
        "instead of the mean of the micro-batch means",
    )
    cross_entropy_loss_fusion: bool = _f(
        False, "fused cross entropy (Megatron: one kernel for the vocab-parallel softmax and NLL)"
    )
    cross_entropy_fusion_impl: str = _f(
        "native", "the fused cross entropy's implementation", choices=["native", "te"]
    )
    masked_softmax_fusion: bool = _f(
        True,
        "fuse the scaling, the causal mask and the softmax of attention (--no-masked-softmax-fusion: not)",
        flag="--no-masked-softmax-fusion",
        action="store_false",
    )
    transformer_impl: str = _f(
        "transformer_engine",
        "which layers: NVIDIA Transformer Engine's (Megatron's default) or local (PyTorch modules)",
        choices=["local", "transformer_engine", "inference_optimized"],
    )
    deprecated_use_mcore_models: bool = _f(
        False,
        "deprecated in Megatron and ignored there: the megatron-core models are the only ones",
        flag="--use-mcore-models",
    )
    profile: bool = _f(
        False,
        "profile --profile-step-start+1..end: an nsys capture range (cudaProfilerStart/Stop), or with "
        "--use-pytorch-profiler a torch.profiler trace (the same as --profile-execution True)",
    )
    use_pytorch_profiler: bool = _f(False, "with --profile: torch.profiler instead of nsys")


@dataclass
class LearningRateArgs:
    """The learning-rate schedule (Megatron's ``_add_learning_rate_args``)."""

    lr: float = _f(None, "peak learning rate (required)")
    lr_decay_style: str = _f("linear", "decay shape", choices=["constant", "linear", "cosine"])
    lr_decay_iters: int = _f(None, "iterations of decay (default --train-iters)")
    lr_warmup_fraction: float = _f(None, "fraction of --lr-decay-iters spent in linear warm-up")
    lr_warmup_iters: int = _f(0, "warm-up iterations (when no fraction is given)")
    min_lr: float = _f(0.0, "learning rate at the end of the decay")
    lr_decay_samples: int = _f(None, "samples of decay (default --train-samples), with --train-samples")
    lr_warmup_samples: int = _f(0, "samples of linear warm-up, with --train-samples")
    decoupled_lr: float = _f(
        None, "peak learning rate of the input embedding and the output layer (their own schedule)"
    )
    decoupled_min_lr: float = _f(None, "final learning rate of the input embedding and the output layer")


@dataclass
class CheckpointingArgs:
    """Checkpoints (Megatron's ``_add_checkpointing_args``)."""

    save: str = _f(None, "checkpoint directory to write")
    save_interval: int = _f(None, "iterations between checkpoints (and one at the end)")
    load: str = _f(None, "checkpoint directory to resume from")
    ckpt_format: str = _f(
        "torch_dist",
        "the format of the saves. torch_dist (Megatron-LM's default): torch.distributed.checkpoint, every "
        "rank writes its shards, loadable by another number of data-parallel ranks, another tp or ep, with "
        "or without FSDP2; torch: one file per tensor/pipeline/expert rank, written by data-parallel rank "
        "0 (Megatron's legacy format). --load reads the format it finds, as Megatron-LM's",
        choices=["torch", "torch_dist"],
    )
    async_save: bool = _f(
        False,
        "with --ckpt-format torch_dist: copy the state to CPU memory, then write it in a thread while "
        "training goes on (dcp.async_save); the next save and the end of training wait for it",
    )
    no_load_optim: bool = _f(False, "with --load: do not load the optimizer state (Adam moments, fp16 scale)")
    no_load_rng: bool = _f(False, "with --load: do not load the random-number generators' states")


@dataclass
class MixedPrecisionArgs:
    """fp16 or bf16, and the loss scale (Megatron's ``_add_mixed_precision_args``)."""

    fp16: bool = _f(False, "float16 compute with dynamic loss scaling")
    bf16: bool = _f(False, "bfloat16 compute")
    initial_loss_scale: float = _f(2.0**32, "first loss scale with --fp16")
    min_loss_scale: float = _f(1.0, "smallest loss scale")
    loss_scale_window: int = _f(1000, "clean steps before the scale doubles")
    hysteresis: int = _f(2, "overflows tolerated before the scale halves")
    grad_reduce_in_bf16: bool = _f(
        False, "reduce the gradients over the data-parallel ranks in bfloat16 (half the bytes of fp32)"
    )
    fp32_residual_connection: bool = _f(
        False,
        "move residual connections to fp32 (Megatron's): the embeddings' output, every block's sums and "
        "the pipeline's messages, which are otherwise in the --bf16 / --fp16 dtype (needs one of them)",
    )


@dataclass
class ValidationArgs:
    """Evaluation (Megatron's ``_add_validation_args``)."""

    eval_iters: int = _f(100, "global batches per validation run")
    eval_interval: int = _f(
        None, "iterations between validation runs (not given: validation only at the end of training)"
    )


@dataclass
class LoggingArgs:
    """The log line and TensorBoard (Megatron's ``_add_logging_args``)."""

    log_interval: int = _f(100, "iterations between log lines")
    tensorboard_dir: str = _f(None, "write TensorBoard scalars here")
    tensorboard_queue_size: int = _f(1000, "events buffered before TensorBoard flushes")
    log_timers_to_tensorboard: bool = _f(False, "also write timers")
    log_batch_size_to_tensorboard: bool = _f(False, "also write the batch size")
    log_validation_ppl_to_tensorboard: bool = _f(False, "also write validation perplexity")
    log_throughput: bool = _f(
        False, "add Megatron's 'throughput per GPU (TFLOP/s/GPU)' field to the iteration line"
    )
