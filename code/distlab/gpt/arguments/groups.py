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
    CheckpointingArgs,
    LearningRateArgs,
    LoggingArgs,
    MixedPrecisionArgs,
    TrainingArgs,
    ValidationArgs,
)


@dataclass
class NetworkSizeArgs:
    """The model's shape and architecture (Megatron's ``_add_network_size_args``, with the fields of
    megatron-core's ``TransformerConfig`` it adds as flags: ``--norm-epsilon`` and the others whose
    ``flag=`` differs from the name). GPT-2 by default; Llama is ``--normalization RMSNorm
    --position-embedding-type rope --swiglu --group-query-attention --num-query-groups g
    --disable-bias-linear --untie-embeddings-and-output-weights`` (``transformer/config.py``)."""

    num_layers: int = _f(None, "transformer blocks (required)")
    hidden_size: int = _f(None, "model width H (required)")
    ffn_hidden_size: int = _f(
        None,
        "MLP width F (default 4H; with --swiglu 2/3 of 4H rounded down to a multiple of 64, as Megatron)",
    )
    num_attention_heads: int = _f(None, "query heads n (required)")
    kv_channels: int = _f(None, "channels d of each attention head (default H / n)")
    group_query_attention: bool = _f(False, "grouped-query attention: --num-query-groups K/V heads")
    num_query_groups: int = _f(
        1,
        "g, with --group-query-attention: K/V heads, each shared by n / g query heads; tp must divide g "
        "(K/V heads split) or g divide tp (replicated)",
    )
    max_position_embeddings: int = _f(None, "learned positions; >= --seq-length (default: seq length)")
    position_embedding_type: str = _f(
        "learned_absolute",
        "learned_absolute: a (max positions, H) table added to the token embedding; rope: rotary "
        "embeddings of q and k (rotate-half, at global positions); none",
        choices=["learned_absolute", "rope", "none"],
    )
    rotary_base: int = _f(10000, "RoPE's base: pair i of a head turns by position x base^(-2i/d_rot)")
    rotary_percent: float = _f(1.0, "fraction of each head's channels RoPE rotates (d_rot = d x it)")
    add_position_embedding: bool = _f(
        True,
        "--no-position-embedding: deprecated in Megatron-LM for --position-embedding-type; accepted with "
        "rope (no learned table either way), refused otherwise",
        flag="--no-position-embedding",
        action="store_false",
    )
    use_rope_scaling: bool = _f(
        False,
        "Llama 3.x's RoPE frequencies (rope_type llama3): the slow ones divided by --rope-scaling-factor",
    )
    rope_scaling_factor: float = _f(
        8.0, "with --use-rope-scaling: Llama 3.x's factor (8 for 3.1, 32 for 3.2)"
    )
    make_vocab_size_divisible_by: int = _f(128, "pad the vocabulary to a multiple of this x tp")
    openai_gelu: bool = _f(
        False, "GeLU's tanh approximation (OpenAI's, GPT-2's gelu_new) instead of the exact erf"
    )
    swiglu: bool = _f(False, "SwiGLU MLP: fc2(silu(x W_gate) * x W_up) instead of fc2(gelu(x W_1))")
    untie_embeddings_and_output_weights: bool = _f(
        False, "the output layer (last stage) has its own weight instead of the word embeddings'"
    )
    normalization: str = _f(
        "LayerNorm", "the norm of every block and of the output", choices=["LayerNorm", "RMSNorm"]
    )
    layernorm_epsilon: float = _f(1e-5, "epsilon of every LayerNorm / RMSNorm", flag="--norm-epsilon")
    layernorm_zero_centered_gamma: bool = _f(
        False,
        "norms store gamma - 1 (initialised 0, applied as 1 + weight; weight decay pulls gamma to 1)",
        flag="--apply-layernorm-1p",
    )
    add_bias_linear: bool = _f(
        True,
        "--disable-bias-linear: no bias in the linear layers (qkv, attention output, both MLP layers)",
        flag="--disable-bias-linear",
        action="store_false",
    )
    add_qkv_bias: bool = _f(False, "a bias on the qkv projection even with --disable-bias-linear (Qwen2)")


@dataclass
class RegularizationArgs:
    """Dropout, weight decay, clipping, the optimizer's constants (Megatron's
    ``_add_regularization_args``)."""

    attention_dropout: float = _f(
        0.1, "dropout on attention probabilities (0 under --context-parallel-size > 1)"
    )
    hidden_dropout: float = _f(0.1, "dropout on the embeddings' output and after attention and MLP")
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
    init_method_std: float = _f(
        0.02,
        "std of the zero-mean normal initialisation of every weight matrix; the attention output and "
        "fc2 use std / sqrt(2L) (Megatron's scaled init)",
    )


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
        "start each bucket's data-parallel all-reduce during the last micro-batch's backward (of each "
        "pipeline stage and model chunk), as soon as its last gradient is accumulated; the step waits "
        "for all before the optimizer",
    )
    use_distributed_optimizer: bool = _f(
        False,
        "Megatron's distributed optimizer (ZeRO-1): parameters in the run's dtype in bucketed buffers, "
        "fp32 gradients reduce-scattered per bucket, fp32 main parameters and Adam's moments sharded "
        "over dp x cp, updated parameters all-gathered: 6 + 12/d bytes per parameter (bf16), 8 + 8/d (fp32)",
    )
    overlap_param_gather: bool = _f(
        False,
        "with --use-distributed-optimizer and --overlap-grad-reduce: each bucket's parameter all-gather "
        "runs while the next forward goes on, waited for by the first module that uses the bucket",
    )
    ddp_bucket_size: int = _f(
        None,
        "elements per gradient bucket (buckets fill in the reverse of the parameters' order); default "
        "Megatron's max(40000000, 1000000 x dp)",
    )
    dry_run_world_size: int = _f(
        None,
        "this course's (torchtitan's dry run; not Megatron's): check the layout for a world of N ranks, build "
        "--dry-run-rank's stage and shard on the meta device under a fake process group, print its model "
        "states, activations and one step's collectives, and exit (distlab/gpt/planning/dry_run.py)",
    )
    dry_run_rank: int = _f(0, "with --dry-run-world-size: the rank to build (0 to N - 1)")
    distributed_backend: str = _f(None, "nccl or gloo (default: from the hardware)", choices=["nccl", "gloo"])
    distributed_timeout_minutes: float = _f(10.0, "collectives fail after waiting this long")
    local_rank: int = _f(
        0, "set by torch.distributed.launch (also as --local_rank); ignored: LOCAL_RANK wins"
    )
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
class StragglerArgs:
    """Megatron's ``_add_straggler_detector_args`` (``training/straggler.py``)."""

    log_straggler: bool = _f(
        False, "every --log-interval: min/max per-rank forward-backward time and TFLOP/s, with their ranks"
    )
    straggler_ctrlr_port: int = _f(65535, "rank 0 listens here; each HTTP request toggles the detector")
    straggler_minmax_count: int = _f(1, "N > 1: also print the N ranks of lowest and highest TFLOP/s")
    disable_straggler_on_startup: bool = _f(
        False, "start with the detector off (turn it on through the port)"
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
    StragglerArgs,
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
