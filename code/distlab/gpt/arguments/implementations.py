"""Megatron's flags that choose only an implementation (of the layers, the cross entropy, the
softmax, the data loader, the profiler): accepted, and the start-up log says which implementation
runs here; the few choices with no counterpart are refused before compute."""

from __future__ import annotations

from distlab.gpt.arguments.groups import PretrainArgs


def implementation_errors(args: PretrainArgs) -> list[str]:
    """--transformer-impl inference_optimized and Transformer Engine's cross entropy refused;
    the --manual-gc-interval and --profile rules."""
    errors = []
    if args.transformer_impl == "inference_optimized":
        errors.append(
            "--transformer-impl inference_optimized: Megatron's inference-only layers cannot train; use "
            "--transformer-impl local (the PyTorch layers this engine runs) or leave the flag out"
        )
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te":
        errors.append(  # Megatron's own assertion
            "--cross-entropy-fusion-impl te: Transformer Engine's fused cross entropy is disabled in "
            "Megatron-LM for stability, and there is no Transformer Engine here: use "
            "--cross-entropy-fusion-impl native or omit --cross-entropy-loss-fusion"
        )
    if args.manual_gc_interval < 0:
        errors.append(f"--manual-gc-interval {args.manual_gc_interval} must be >= 0 (0: never between steps)")
    if args.grad_reduce_in_bf16 and not args.bf16:
        errors.append(
            "--grad-reduce-in-bf16 without --bf16: Megatron reads it in bf16 runs only (an fp32 or fp16 "
            "run reduces its gradients in their own dtype): add --bf16 or drop it"
        )
    if args.grad_reduce_in_bf16 and (args.deepspeed or args.use_torch_fsdp2):
        errors.append(
            "--grad-reduce-in-bf16 with --deepspeed / --use-torch-fsdp2: those back ends reduce the "
            "gradients in their own dtype; it applies to this engine's own data-parallel buckets: drop it"
        )
    if args.use_pytorch_profiler and not args.profile:
        errors.append("--use-pytorch-profiler was given without --profile: add --profile")
    return errors


def apply_profile_flags(args: PretrainArgs) -> None:
    """Megatron's ``--profile --use-pytorch-profiler`` is this engine's ``--profile-execution True``."""
    if args.profile and args.use_pytorch_profiler:
        args.profile_execution = True


def implementation_lines(args: PretrainArgs, cuda: bool) -> list[str]:
    """The start-up lines that say which implementation runs for each such flag given."""
    lines = []
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        lines.append(
            "> --sequence-parallel with --tensor-model-parallel-size 1: off, as Megatron turns it off "
            "(there are no tensor-parallel ranks to split the sequence over)"
        )
    impl = (
        "transformer_engine (Megatron's default): no Transformer Engine here, so"
        if args.transformer_impl == "transformer_engine"
        else "local:"
    )
    lines.append(
        f"> --transformer-impl {impl} the local layers run (PyTorch modules); each rank reads its samples "
        f"in the training process (--num-workers {args.num_workers}: Megatron's DataLoader workers, none here)"
    )
    if args.deprecated_use_mcore_models:
        lines.append(
            "> --use-mcore-models: deprecated and ignored, as in Megatron (one model implementation)"
        )
    if args.cross_entropy_loss_fusion:
        ce = (
            "PyTorch's F.cross_entropy (one fused log-softmax and NLL kernel, in fp32)"
            if args.tensor_model_parallel_size == 1
            else "vocab-parallel cross entropy of PyTorch operations (two all-reduces of per-token vectors)"
        )
        lines.append(f"> --cross-entropy-loss-fusion: Megatron's fused kernel is not here; {ce} runs")
    if not args.masked_softmax_fusion:
        lines.append(
            "> --no-masked-softmax-fusion: attention's scale, causal mask and softmax run as "
            f"--attention-backend {args.attention_backend} runs them (no Megatron fused kernel either way)"
        )
    if not args.create_attention_mask_in_dataloader:
        lines.append(
            "> --no-create-attention-mask-in-dataloader: no mask is ever built by the data loader here; "
            "attention applies the causal mask itself"
        )
    if args.calculate_per_token_loss:
        lines.append(
            "> --calculate-per-token-loss: every sample has --seq-length tokens and none is masked "
            "(no padding, no --eod-mask-loss), so the global batch's summed token losses over its "
            "number of tokens is the mean of the micro-batch means that runs"
        )
    if args.empty_unused_memory_level and not cuda:
        lines.append(
            f"> --empty-unused-memory-level {args.empty_unused_memory_level}: no CUDA caching allocator "
            f"on a CPU, nothing to empty"
        )
    if args.profile and not args.use_pytorch_profiler:
        lines.append(
            f"> --profile: nsys capture range (cudaProfilerStart/Stop) over iterations "
            f"{args.profile_step_start + 1}-{args.profile_step_end}"
            + ("" if cuda else ": no CUDA here, nothing is captured; --use-pytorch-profiler traces them")
        )
    if args.vocab_size is not None and args.tokenizer_type not in (None, "NullTokenizer"):
        lines.append(
            f"> --vocab-size {args.vocab_size}: read by NullTokenizer only (as Megatron's tokenizer "
            f"builder); {args.tokenizer_type} brings its own vocabulary"
        )
    if args.tiktoken_pattern is not None and args.tokenizer_type != "TikTokenizer":
        lines.append(f"> --tiktoken-pattern {args.tiktoken_pattern}: read by TikTokenizer only, ignored")
    return lines
