"""What the memory estimate depends on: a model shape and how it is trained (``memory_estimate.py``
adds up its bytes). A run's setup is built from its :class:`~distlab.gpt.layout.Layout` and obeys
the layout's rules (``layout.py``); torch-free, as the estimator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from distlab.gpt.layout import Layout
from distlab.gpt.model_layout import ModelShape, check_model_layout
from distlab.gpt.transformer.recompute import ATTENTION_BACKENDS, granularity_of, recompute_errors

if TYPE_CHECKING:
    from distlab.gpt.arguments import PretrainArgs

#: The half precisions (autocast over fp32 weights).
HALF = ("fp16", "bf16")


@dataclass(frozen=True)
class MemorySetup:
    """A model shape and how it is trained: everything the estimate depends on. A run's setup is
    built from its :class:`~distlab.gpt.layout.Layout` (:meth:`from_layout`, :meth:`from_run`)
    and obeys the layout's rules; the sizes are fields too, for what-if questions."""

    num_layers: int
    """L, blocks in the whole model."""
    hidden_size: int
    """h."""
    num_attention_heads: int
    """a."""
    seq_length: int
    """s."""
    vocab_size: int
    """V, the padded vocabulary."""
    micro_batch_size: int
    """b."""
    precision: str = "fp32"
    """fp32, fp16 or bf16 (autocast over fp32 weights, as ``pretrain_gpt.py`` runs)."""
    recompute_granularity: str | None = None
    """None, "selective" or "full" (``--recompute-granularity``; ``--recompute-activations`` is selective)."""
    recompute_method: str | None = None
    """With full: "uniform" or "block"."""
    recompute_num_layers: int | None = None
    """N, with full."""
    attention_backend: str = "auto"
    """``--attention-backend``: unfused and local store the scores, the others do not."""
    num_micro_batches: int = 1
    """M, gradient-accumulation steps (micro-batches per step on this rank)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    """Context parallelism: s / cp tokens of every sample on this rank."""
    pipeline_schedule: str = "1f1b"
    vp: int = 1
    """v, model chunks per pipeline rank (interleaved 1F1B when > 1)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 0-3 (0: plain data parallelism, DDP)."""
    offload: bool = False
    """DeepSpeed offload of the optimizer state (stage 3: and parameters) to the CPU; with
    ``fsdp2``, FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state)."""
    fsdp2: bool = False
    """PyTorch FSDP2 (``--use-torch-fsdp2``): fp32 states sharded over dp as ZeRO-3, plus the
    parameters gathered for compute (``gathered_bytes``)."""
    fsdp2_reshard_after_forward: bool = True
    distributed_optimizer: bool = False
    """``--use-distributed-optimizer``: parameters in the run's dtype, fp32 main parameters and
    moments sharded over dp x cp (Megatron's ZeRO-1)."""
    grad_reduce_in_bf16: bool = False
    """``--grad-reduce-in-bf16``: with the distributed optimizer, a bf16 gradient buffer."""
    num_experts: int | None = None
    """E, experts per MoE layer (None: dense MLPs)."""
    ep: int = 1
    """Expert-model-parallel size: each rank holds E / ep experts per layer."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: activations outside the tp GEMMs split along s over tp."""
    tensor_parallel_impl: str = "megatron"
    """``--tensor-parallel-impl``: "dtensor" keeps the gathered LN outputs and the vocabulary whole."""
    ffn_hidden_size: int | None = None
    """F, the MLP width (4h when None)."""
    num_query_groups: int | None = None
    """g, K/V heads (None: a, multi-head)."""
    kv_channels: int | None = None
    """d, channels per head (None: h / a)."""
    swiglu: bool = False
    """Three F x h matrices in the MLP (gate, up, down) instead of two."""
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    """qkv's bias alone (``--add-qkv-bias``, Qwen2)."""
    normalization: str = "LayerNorm"
    """RMSNorm has a weight and no bias."""
    position_embedding_type: str = "learned_absolute"
    """Only learned_absolute holds a (s, h) position table."""
    untie_embeddings_and_output_weights: bool = False
    """The last stage holds its own (V, h) output layer."""
    fp32_residual_connection: bool = False
    """``--fp32-residual-connection``: the residual stream in fp32 under fp16 / bf16 (else half)."""

    def __post_init__(self) -> None:
        check_model_layout(self.shape, self.layout)  # the run's rules (distlab/gpt/model_layout.py)
        if self.tensor_parallel_impl not in ("megatron", "dtensor"):
            raise ValueError(
                f"tensor_parallel_impl {self.tensor_parallel_impl!r} must be megatron or dtensor"
            )
        if self.precision not in ("fp32", *HALF):
            raise ValueError(f"precision {self.precision!r} must be fp32, fp16 or bf16")
        if self.fp32_residual_connection and self.precision not in HALF:
            raise ValueError(
                f"fp32_residual_connection with precision {self.precision!r}: the residual stream is "
                f"fp32 already; give precision fp16 or bf16, or drop fp32_residual_connection"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero stage {self.zero_stage} must be 0, 1, 2 or 3")
        if self.distributed_optimizer and (self.zero_stage or self.fsdp2):
            raise ValueError(
                "the distributed optimizer is the engine's own: not with DeepSpeed ZeRO or FSDP2"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention backend {self.attention_backend!r} must be one of {ATTENTION_BACKENDS}"
            )
        errors = recompute_errors(
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
            self.num_layers // (self.pp * self.vp),
        )
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def layout(self) -> Layout:
        """The layout these sizes describe (world tp x cp x dp x pp; B = b x dp x M), checked by
        the layout's own rules (ep over dp x cp, the interleaved schedule's micro-batches)."""
        return Layout(
            self.tp * self.cp * self.dp * self.pp,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.micro_batch_size * self.dp * self.num_micro_batches,
            vp=self.vp,
            sequence_parallel=self.sequence_parallel,
        )

    @property
    def shape(self) -> ModelShape:
        """The sizes ``model_layout``'s rules read."""
        return ModelShape(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            seq_length=self.seq_length,
            ffn_hidden_size=self.ffn_hidden_size,
            num_query_groups=self.num_query_groups,
            vocab_size=self.vocab_size,
            num_experts=self.num_experts,
        )

    @classmethod
    def from_layout(cls, layout: Layout, **setup) -> MemorySetup:
        """The setup of a model trained on ``layout``: the parallel sizes (tp, pp, dp, cp, vp, ep),
        sequence parallelism, the micro batch b and the m micro-batches of the final global batch
        are read from it, not declared again; ``setup`` gives the rest."""
        return cls(
            **setup,
            micro_batch_size=layout.micro_batch_size,
            num_micro_batches=layout.num_micro_batches,
            tp=layout.tp,
            pp=layout.pp,
            dp=layout.dp,
            cp=layout.cp,
            vp=layout.vp,
            ep=layout.ep,
            sequence_parallel=layout.sequence_parallel,
        )

    @classmethod
    def from_run(
        cls, args: PretrainArgs, layout: Layout, vocab_size: int, deepspeed_config: dict | None = None
    ) -> MemorySetup:
        """The setup of a validated run: its arguments, layout (sizes, b, m at the final global
        batch), padded vocabulary and DeepSpeed config (ZeRO stage, offload), if any."""
        zero = (deepspeed_config or {}).get("zero_optimization", {})
        return cls.from_layout(
            layout,
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length,
            vocab_size=vocab_size,
            precision="fp16" if args.fp16 else "bf16" if args.bf16 else "fp32",
            fp32_residual_connection=args.fp32_residual_connection,
            recompute_granularity=granularity_of(args.recompute_activations, args.recompute_granularity),
            recompute_method=args.recompute_method,
            recompute_num_layers=args.recompute_num_layers,
            attention_backend=args.attention_backend,
            pipeline_schedule=args.pipeline_schedule,
            zero_stage=zero.get("stage", 0),
            offload=zero.get("offload_optimizer", {}).get("device", "none") == "cpu"
            or (args.use_torch_fsdp2 and args.torch_fsdp2_cpu_offload),
            fsdp2=args.use_torch_fsdp2,
            distributed_optimizer=args.use_distributed_optimizer,
            grad_reduce_in_bf16=args.grad_reduce_in_bf16,
            fsdp2_reshard_after_forward=args.torch_fsdp2_reshard_after_forward,
            num_experts=args.num_experts,
            tensor_parallel_impl=args.tensor_parallel_impl,
            ffn_hidden_size=args.ffn_hidden_size,
            num_query_groups=args.num_query_groups if args.group_query_attention else None,
            kv_channels=args.kv_channels,
            swiglu=args.swiglu,
            add_bias_linear=args.add_bias_linear,
            add_qkv_bias=args.add_qkv_bias,
            normalization=args.normalization,
            position_embedding_type=args.position_embedding_type,
            untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        )
