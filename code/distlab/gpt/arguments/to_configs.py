"""The command line mapped to the core's typed configs, once: the only place that reads
``PretrainArgs`` for the model, the optimizer, the gradients, the checkpoints and the logs.

Megatron Core never imports its command line: ``megatron/training`` turns the arguments into
``TransformerConfig``, ``OptimizerConfig``, ``DistributedDataParallelConfig`` and the scheduler's
arguments. Here ``transformer/``, ``optimizer/``, ``distributed/``, ``checkpointing/`` and
``training/`` likewise take the configs below and never import ``arguments/``
(``tests/test_imports.py`` checks it); ``build.py`` calls these functions for a run::

    model_config        GPTConfig (with moe_config's MoEConfig)     transformer/config.py
    optimizer_config    OptimizerConfig                             optimizer/optimizer_config.py
    lr_schedule         LRSchedule (in samples)                     optimizer/optimizer_param_scheduler.py
    precision_config    Precision                                   optimizer/precision.py
    ddp_config          DistributedDataParallelConfig               distributed/distributed_data_parallel_config.py
    checkpoint_config   CheckpointConfig                            checkpointing/checkpoint_config.py
    logging_config      LoggingConfig                               training/log.py
    profiler_config     ProfilerConfig                              training/log.py
    housekeeping_config HousekeepingConfig                          training/housekeeping.py
    flops_config        FlopsConfig                                 training/flops.py

``args`` are validated (``validate_args``), except in tests and tools that build parts by hand.
"""

from __future__ import annotations

import dataclasses

from distlab.gpt.arguments.architecture import query_groups
from distlab.gpt.arguments.groups import PretrainArgs
from distlab.gpt.arguments.parser import as_list
from distlab.gpt.checkpointing.checkpoint_config import CheckpointConfig
from distlab.gpt.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from distlab.gpt.optimizer.optimizer_config import OptimizerConfig
from distlab.gpt.optimizer.optimizer_param_scheduler import LRSchedule
from distlab.gpt.optimizer.precision import Precision
from distlab.gpt.training.flops import FlopsConfig
from distlab.gpt.training.housekeeping import HousekeepingConfig
from distlab.gpt.training.log import LoggingConfig, ProfilerConfig
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.moe.moe_layer import MoEConfig
from distlab.gpt.transformer.recompute import granularity_of


def moe_config(args: PretrainArgs) -> MoEConfig | None:
    """``--num-experts`` and the ``--moe-*`` flags; None for dense MLPs."""
    if args.num_experts is None:
        return None
    [balancing], [coeff] = as_list(args.moe_router_load_balancing_type), as_list(args.moe_aux_loss_coeff)
    return MoEConfig(
        num_experts=args.num_experts,
        topk=args.moe_router_topk,
        aux_loss_coeff=coeff,
        capacity_factor=args.moe_expert_capacity_factor,
        token_dispatcher=args.moe_token_dispatcher_type,
        load_balancing_type=balancing,
        grouped_gemm=args.moe_grouped_gemm,
        gated_linear_unit=args.swiglu,
        add_bias_linear=args.add_bias_linear,
        openai_gelu=args.openai_gelu,
    )


def model_config(args: PretrainArgs, vocab_size: int, sequence_parallel: bool = False) -> GPTConfig:
    """The ``GPTConfig`` of V = ``vocab_size`` padded rows (``build.build_model``'s; the converters
    and ``generate.py`` build the whole model of a checkpoint from its saved arguments)."""
    return GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=query_groups(args),
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        layernorm_zero_centered_gamma=args.layernorm_zero_centered_gamma,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        openai_gelu=args.openai_gelu,
        swiglu=args.swiglu,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        recompute_granularity=granularity_of(args.recompute_activations, args.recompute_granularity),
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        attention_backend=args.attention_backend,
        seed=args.seed,
        moe=moe_config(args),
        sequence_parallel=sequence_parallel,
        fp32_residual_connection=args.fp32_residual_connection,
    )


def optimizer_config(args: PretrainArgs) -> OptimizerConfig:
    """``--optimizer``, the learning rates, ``--weight-decay``, Adam's and SGD's constants,
    ``--clip-grad`` and ``--use-distributed-optimizer``."""
    return OptimizerConfig(
        lr=args.lr,
        min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay,
        optimizer=args.optimizer,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def lr_schedule(args: PretrainArgs) -> LRSchedule:
    """Warm-up and decay in samples (``optimizer_param_scheduler.py``'s table): from ``--lr-decay-iters`` and
    ``--lr-warmup-iters`` (or ``--lr-warmup-fraction``) times the global batch B, or with
    ``--train-samples`` from ``--lr-decay-samples`` and ``--lr-warmup-samples`` (or the fraction)."""
    batch = args.global_batch_size or 1  # set by validate_args; 1 for bare arguments
    if args.train_samples is not None:
        decay = args.lr_decay_samples or args.train_samples
        warmup = (
            args.lr_warmup_samples if args.lr_warmup_fraction is None else args.lr_warmup_fraction * decay
        )
    else:
        decay_iters = args.lr_decay_iters or args.train_iters
        warmup_iters = args.lr_warmup_iters
        if args.lr_warmup_fraction is not None:
            warmup_iters = int(args.lr_warmup_fraction * decay_iters)
        decay, warmup = decay_iters * batch, warmup_iters * batch
    return LRSchedule(
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=args.lr_decay_style,
        global_batch_size=batch,
    )


def precision_config(args: PretrainArgs) -> Precision:
    """``--fp16`` or ``--bf16`` (else fp32), fp16's loss-scale flags, ``--fp32-residual-connection``."""
    name = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    return Precision(
        name,
        args.initial_loss_scale,
        args.min_loss_scale,
        args.loss_scale_window,
        args.hysteresis,
        fp32_residual_connection=args.fp32_residual_connection,
    )


def ddp_config(args: PretrainArgs) -> DistributedDataParallelConfig:
    """``--overlap-grad-reduce``, ``--overlap-param-gather``, ``--ddp-bucket-size``, ``--grad-reduce-in-bf16``."""
    return DistributedDataParallelConfig(
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        bucket_size=args.ddp_bucket_size,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
    )


def checkpoint_config(args: PretrainArgs) -> CheckpointConfig:
    """``--save``, ``--load``, ``--ckpt-format``, ``--async-save``, ``--no-load-optim``,
    ``--no-load-rng``; the arguments themselves, which every checkpoint carries."""
    return CheckpointConfig(
        save=args.save,
        load=args.load,
        ckpt_format=args.ckpt_format,
        async_save=args.async_save,
        no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        arguments=dataclasses.asdict(args),
    )


def logging_config(args: PretrainArgs) -> LoggingConfig:
    """The run's length and batch, ``--log-interval``, ``--log-throughput`` and the TensorBoard flags."""
    return LoggingConfig(
        train_iters=args.train_iters,
        global_batch_size=args.global_batch_size,
        seq_length=args.seq_length,
        log_interval=args.log_interval,
        log_throughput=args.log_throughput,
        tensorboard_dir=args.tensorboard_dir,
        tensorboard_queue_size=args.tensorboard_queue_size,
        log_timers_to_tensorboard=args.log_timers_to_tensorboard,
        log_batch_size_to_tensorboard=args.log_batch_size_to_tensorboard,
        log_validation_ppl_to_tensorboard=args.log_validation_ppl_to_tensorboard,
        log_loss_scale_to_tensorboard=args.fp16,
    )


def profiler_config(args: PretrainArgs) -> ProfilerConfig:
    """``--profile-execution`` (or ``--profile --use-pytorch-profiler``), ``--profile``'s nsys range,
    ``--profile-ranks``, ``--profile-step-start/end``, ``--profile-name`` under ``--tensorboard-dir``."""
    return ProfilerConfig(
        profile_execution=args.profile_execution,
        profile=args.profile,
        use_pytorch_profiler=args.use_pytorch_profiler,
        profile_ranks=frozenset(args.profile_ranks),
        profile_step_start=args.profile_step_start,
        profile_step_end=args.profile_step_end,
        tensorboard_dir=args.tensorboard_dir,
        profile_name=args.profile_name,
    )


def housekeeping_config(args: PretrainArgs) -> HousekeepingConfig:
    """``--manual-gc``, ``--manual-gc-interval``, ``--no-manual-gc-eval``, ``--empty-unused-memory-level``."""
    return HousekeepingConfig(
        manual_gc=args.manual_gc,
        manual_gc_interval=args.manual_gc_interval,
        manual_gc_eval=args.manual_gc_eval,
        empty_unused_memory_level=args.empty_unused_memory_level,
    )


def flops_config(args: PretrainArgs, vocab_size: int) -> FlopsConfig:
    """The model (:func:`model_config`), ``--seq-length``, ``--global-batch-size`` and the pp x v
    model chunks (``--pipeline-model-parallel-size``, ``--virtual-pipeline-model-parallel-size``)."""
    return FlopsConfig(
        model=model_config(args, vocab_size),
        seq_length=args.seq_length,
        global_batch_size=args.global_batch_size,
        model_chunks=args.pipeline_model_parallel_size * (args.virtual_pipeline_model_parallel_size or 1),
    )
