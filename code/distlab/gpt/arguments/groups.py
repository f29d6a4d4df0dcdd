"""The flags of ``pretrain_gpt.py``, grouped as Megatron-LM's ``arguments.py`` adds them.

Every field is a flag: ``num_layers`` is ``--num-layers`` (``fields.py``). Booleans are Megatron's switches
(``--fp16``), except the few the course passes as ``True|False`` (``--profile-execution True``,
``tf=True``); ``flag=`` spells a flag Megatron-DeepSpeed's way. Each group is the dataclass of one
of Megatron's ``_add_*_args`` functions, and :class:`PretrainArgs` is all of them: the single
source of names, types, defaults and help, from which ``parser.py`` builds argparse. The groups
of training, learning rate, checkpoints, precision, validation and logging are in
``training_groups.py``, data and tokenizer in ``data_groups.py``, the flags parsed only to be
refused in ``refused.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.gpt.arguments.data_groups import DataArgs, TokenizerArgs
from distlab.gpt.arguments.fields import _f
from distlab.gpt.arguments.refused import RefusedArgs
from distlab.gpt.arguments.training_groups import (
    SIGNALS,  # noqa: F401 - --exit-signal's choices, where training/fault_handling.py reads them
    CheckpointingArgs,
    LearningRateArgs,
    LoggingArgs,
    MixedPrecisionArgs,
    TrainingArgs,
    ValidationArgs,
)


@dataclass
class NetworkSizeArgs:
    """The model's shape (Megatron's ``_add_network_size_args``)."""

    num_layers: int = _f(None, "transformer blocks (required)")
    hidden_size: int = _f(None, "model width H (required)")
    ffn_hidden_size: int = _f(None, "MLP width F (default 4H)")
    num_attention_heads: int = _f(None, "attention heads; H must be divisible by it (required)")
    max_position_embeddings: int = _f(None, "learned positions; >= --seq-length (default: seq length)")
    make_vocab_size_divisible_by: int = _f(128, "pad the vocabulary to a multiple of this x tp")


@dataclass
class RegularizationArgs:
    """Dropout, weight decay, clipping, the optimizer's constants (Megatron's
    ``_add_regularization_args``)."""

    attention_dropout: float = _f(0.0, "dropout on attention probabilities")
    hidden_dropout: float = _f(0.0, "dropout after attention and MLP (Megatron's default is 0.1)")
    weight_decay: float = _f(0.01, "decoupled weight decay (not on biases and LayerNorm)")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.999, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam epsilon")
    sgd_momentum: float = _f(0.9, "SGD momentum")


@dataclass
class InitializationArgs:
    """The seed and the initialisation (Megatron's ``_add_initialization_args``)."""

    seed: int = _f(1234, "seed of initialisation, data shuffling and dropout")
    init_method_std: float = _f(0.02, "std of the normal initialisation; output layers use std/sqrt(2L)")


@dataclass
class DistributedArgs:
    """The parallel sizes, the data-parallel gradients, DTensor and FSDP2 (Megatron's
    ``_add_distributed_args``)."""

    tensor_model_parallel_size: int = _f(1, "ranks sharing each layer (tensor parallelism)")
    tensor_parallel_impl: str = _f(
        "megatron",
        "who splits the layers when tp > 1: this engine's Megatron-style layers (megatron) or PyTorch's "
        "DTensor parallelize_module plans on a DeviceMesh (dtensor; combines with --use-torch-fsdp2)",
        choices=["megatron", "dtensor"],
    )
    pipeline_model_parallel_size: int = _f(1, "pipeline stages")
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


@dataclass
class MoEArgs:
    """Mixture of experts (Megatron's ``_add_moe_args`` and the MoE fields of its ``TransformerConfig``)."""

    num_experts: int = _f(
        None, "experts E per MoE layer: every block's MLP becomes a router and E experts (None: dense)"
    )
    expert_model_parallel_size: int = _f(
        1,
        "ep: the data-parallel (x context-parallel) ranks over which each layer's experts are split "
        "(E / ep per rank); divides dp x cp",
    )
    expert_tensor_parallel_size: int = _f(
        None,
        "etp: tensor parallelism inside each expert (default: --tensor-model-parallel-size, the only "
        "size built here: the experts' MLPs are split over the tp ranks)",
    )
    moe_router_topk: int = _f(2, "k: experts per token (softmax over the k largest router logits)")
    moe_router_load_balancing_type: list = _f(
        "aux_loss",
        "aux_loss (Switch/GShard, per micro-batch) or none; Megatron's seq_aux_loss, global_aux_loss, "
        "sinkhorn and quantile_balancing are refused with the reason",
        nargs="+",
        type=str,
        choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"],
    )
    moe_aux_loss_coeff: list = _f(
        0.0,
        "weight of the Switch/GShard load-balancing loss E sum_i f_i P_i added to the lm loss (1e-2 is a "
        "start); one per --moe-router-load-balancing-type",
        nargs="+",
        type=float,
    )
    moe_expert_capacity_factor: float = _f(
        None,
        "c: each expert keeps at most ceil(k N / E x c) of a micro-batch's N tokens (those of highest router "
        "probability) and drops the rest; None (or negative): dropless",
    )
    moe_token_dispatcher_type: str = _f(
        "allgather",
        "how tokens reach experts on other ranks: allgather (Megatron's default: every token to every "
        "rank of the tp x ep group, reduce-scatter back) or alltoall (only the routed pairs travel, in "
        "uneven all-to-alls)",
        choices=["allgather", "alltoall", "flex"],
    )
    moe_grouped_gemm: bool = _f(
        False,
        "Megatron: one grouped GEMM (Transformer Engine, CUDA) for the local experts; accepted here, where "
        "the local experts run in a loop (the log says so)",
    )


@dataclass
class DeepSpeedArgs:
    """DeepSpeed ZeRO (Megatron-DeepSpeed's ``deepspeed.add_config_arguments``)."""

    deepspeed: bool = _f(False, "train through DeepSpeed's engine (ZeRO); data parallelism only")
    deepspeed_config: str = _f(
        None, "DeepSpeed JSON config; its missing batch keys come from the run", flag="--deepspeed_config"
    )
    zero_stage: int = _f(None, "ZeRO stage 0-3, overriding the config's zero_optimization.stage")


@dataclass
class PretrainArgs(
    RefusedArgs,
    DeepSpeedArgs,
    MoEArgs,
    LoggingArgs,
    TokenizerArgs,
    DataArgs,
    ValidationArgs,
    DistributedArgs,
    MixedPrecisionArgs,
    CheckpointingArgs,
    LearningRateArgs,
    InitializationArgs,
    TrainingArgs,
    RegularizationArgs,
    NetworkSizeArgs,
):
    """Arguments of ``pretrain_gpt.py``; names and meanings follow Megatron-LM. One flat dataclass
    of Megatron's groups: a dataclass takes its bases' fields in reverse order, so the flags are
    listed network size first, as Megatron's ``parse_args`` adds its groups."""
