"""The architecture flags (``--normalization``, ``--swiglu``, ``--group-query-attention``, RoPE, ...):
Megatron's defaults filled in and every rule checked before a process group exists.

Defaults, as Megatron-LM's ``validate_args`` sets them: ``--ffn-hidden-size`` is 4H (left None
here, which the model reads as 4H, so that checkpoints record what they always did), or with
``--swiglu`` ``int(4H x 2/3 / 64) x 64`` (three matrices of that width hold about the parameters
of GeLU's two of 4H); ``--kv-channels`` is H / n. Without ``--group-query-attention`` the query
groups are the heads, whatever ``--num-query-groups`` says (megatron-core gets None).
"""

from __future__ import annotations

from distlab.gpt.arguments.groups import PretrainArgs
from distlab.gpt.layout import Layout
from distlab.gpt.transformer.config import architecture_errors, rotary_errors, variant_errors


def fill_architecture_defaults(args: PretrainArgs) -> None:
    """``--ffn-hidden-size`` and ``--kv-channels`` when not given (Megatron's rules)."""
    h, n = args.hidden_size, args.num_attention_heads
    if args.ffn_hidden_size is None and args.swiglu:  # without it None stays 4H (GPTConfig.ffn), as
        args.ffn_hidden_size = int((4 * h * 2 / 3) / 64) * 64  # checkpoints and converted models record it
    if args.kv_channels is None and h % n == 0:
        args.kv_channels = h // n


def query_groups(args: PretrainArgs) -> int | None:
    """g for ``GPTConfig``: ``--num-query-groups`` with ``--group-query-attention``, else None (n)."""
    return args.num_query_groups if args.group_query_attention else None


def _dtensor_architecture_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """PyTorch's ColwiseParallel cuts contiguous rows: it cannot split fc1's [gate; up] per rank or
    gather the qkv of replicated K/V heads."""
    if args.tensor_parallel_impl != "dtensor" or layout.tp == 1:
        return []
    errors = []
    if args.swiglu:
        errors.append(
            f"--swiglu with --tensor-parallel-impl dtensor and tp {layout.tp}: each rank must hold its own "
            f"slices of fc1's gate and up matrices (stride 2), which ColwiseParallel's contiguous rows are "
            f"not; use --tensor-parallel-impl megatron"
        )
    if args.group_query_attention and args.num_query_groups < layout.tp:
        errors.append(
            f"--num-query-groups {args.num_query_groups} below tp {layout.tp} with --tensor-parallel-impl "
            f"dtensor: replicated K/V heads need the gathered qkv of this engine's layers; use "
            f"--tensor-parallel-impl megatron or --num-query-groups a multiple of {layout.tp}"
        )
    return errors


def architecture_args_errors(args: PretrainArgs, layout: Layout) -> list[str]:
    """Every rule of the architecture flags, against each other and the layout."""
    errors = architecture_errors(
        args.num_attention_heads, query_groups(args), args.normalization, args.position_embedding_type
    )
    if args.kv_channels is None or args.kv_channels < 1:
        errors.append(
            f"--kv-channels {args.kv_channels}: give the channels of each head (>= 1); without it "
            f"--hidden-size {args.hidden_size} must divide by --num-attention-heads {args.num_attention_heads}"
        )
    elif args.position_embedding_type == "rope":
        errors += rotary_errors(args.kv_channels, args.rotary_percent)
    errors += variant_errors(
        args.position_embedding_type, args.use_rope_scaling, args.openai_gelu, args.swiglu
    )
    if args.ffn_hidden_size is not None and args.ffn_hidden_size < 1:
        errors.append(f"--ffn-hidden-size {args.ffn_hidden_size} must be >= 1")
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        errors.append(
            f"--no-position-embedding with --position-embedding-type {args.position_embedding_type}: "
            f"Megatron-LM deprecated the flag; use --position-embedding-type none (or rope)"
        )
    return errors + _dtensor_architecture_errors(args, layout)
