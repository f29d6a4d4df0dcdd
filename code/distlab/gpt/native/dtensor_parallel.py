"""Tensor and sequence parallelism with PyTorch's DTensor (``--tensor-parallel-impl dtensor``).

The same split as ``tensor_parallel/layers.py`` (Megatron-LM's, Shoeybi et al. 2019), declared
instead of written: every block's four linear layers are built unsharded (``nn.Linear``), then
``parallelize_module`` turns their weights into DTensors on the ``tp`` dimension of the mesh and
inserts the collectives. With ``Y = GeLU(X A) C``, ``A = [A_1 .. A_p]`` by columns and ``C`` by rows::

    hand-written (tensor_parallel/layers.py) parallelize_module plan (this file)
    qkv, fc1 : ColumnParallelLinear, f       ColwiseParallel   weight Shard(0): X Replicate in,
                                             f's backward all-reduce = Partial -> Replicate of dX
    proj, fc2: RowParallelLinear, g          RowwiseParallel   weight Shard(1): Partial out,
                                             g's all-reduce = Partial -> Replicate
    --sequence-parallel: norms on T / p      SequenceParallel on ln1, ln2 (input Shard(1))
    g: all-gather of the sequence forward,   PrepareModuleInput(Shard(1) -> Replicate) on attn, mlp
       reduce-scatter of dX backward
    g-bar: reduce-scatter to the sequence    RowwiseParallel(output_layouts=Shard(1))
       forward, all-gather backward
    layer-norm gradients all-reduced on tp   the norms' Partial(sum) gradients made Replicate
                                             (:func:`reduce_partial_gradients`, before the norm)

So per block and micro-batch, tp > 1: 2 all-reduces forward and 2 backward without SP; with SP
2 all-gathers + 2 reduce-scatters forward and as many backward (the same bytes). The embeddings,
the final LayerNorm and the tied output layer stay whole on every tp rank (plain tensors, the same
gradients everywhere); with SP the residual stream between blocks is this rank's (b, T / p, H)
slice: ``layers.<first>`` cuts it from the replicated embedding output (backward: one all-gather),
``ln_f`` gathers it back (one all-gather forward).

Dropout (``tensor_parallel/rng_tracker.py``): the embeddings' output is replicated, so its dropout
draws one mask from the default stream, the same on every tp rank, before the cut (each rank keeps
its slice of it; the embeddings' gradient, all-gathered by the cut's backward, is then the same on
every tp rank). Inside the blocks, each rank's heads and, with SP, its T / p positions of the
residual stream draw from the model-parallel stream (:func:`parallelize` marks the blocks).

The mesh: one ``DeviceMesh`` of the validated :class:`~distlab.gpt.layout.Layout`, its dimensions
:data:`~distlab.gpt.layout.ORDER` slowest first (``("pp", "dp", "tp")``): row-major rank order is
then Megatron's, so ``mesh["tp"]`` holds the same ranks as ``state.tp_group`` and ``mesh["dp"]``
the ``state.dp_group``, where ``--use-torch-fsdp2`` shards (FSDP x TP, torchtitan's 2-D layout).

Why ``--tensor-parallel-impl {megatron,dtensor}``: Megatron-LM picks a layer implementation with
``--transformer-impl {local,transformer_engine}``; PyTorch names its mechanism after the tensor
subclass every API here is built on (``torch.distributed.tensor``, "DTensor"), while the engine's
own layers are Megatron's. The flag says whose implementation splits the same layout.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from distlab.gpt.layout import ORDER, Layout
from distlab.gpt.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from distlab.gpt.transformer.gpt_model import GPTModel

IMPLEMENTATIONS = ("megatron", "dtensor")


#: The mesh's dimensions, slowest first: :data:`ORDER`'s, without cp (this path refuses cp > 1).
MESH_DIMS = tuple(d for d in reversed(ORDER) if d != "cp")


def device_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The run's mesh, ``layout``'s sizes with :data:`ORDER`'s slowest dimension first.

    World 4, tp 2: ``pp 1 x dp 2 x tp 2``, ranks ``[[[0, 1], [2, 3]]]``: tp groups [0,1] [2,3],
    dp groups [0,2] [1,3], as ``layout.groups``."""
    world = dist.get_world_size()
    if layout.world_size != world:
        sizes = " x ".join(f"{d} {layout.size(d)}" for d in MESH_DIMS)
        raise ValueError(
            f"a DeviceMesh of {sizes} = {layout.world_size} ranks does not match the world size {world}: "
            f"launch {layout.world_size} processes or change the parallel sizes"
        )
    return init_device_mesh(device.type, tuple(layout.size(d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)


def block_plan(prefix: str, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One block's plan: Megatron's column / row split, and with SP the norms on T / p."""
    plan: dict[str, ParallelStyle] = {
        f"{prefix}attn.qkv": ColwiseParallel(),
        f"{prefix}mlp.fc1": ColwiseParallel(),
    }
    if not sequence_parallel:
        return plan | {f"{prefix}attn.proj": RowwiseParallel(), f"{prefix}mlp.fc2": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan | {
        f"{prefix}ln1": SequenceParallel(),  # (b, T/p, H) in, DTensor Shard(1) out
        f"{prefix}attn": gather,  # all-gather forward, reduce-scatter of dX backward
        f"{prefix}attn.proj": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter: (b, T/p, H)
        f"{prefix}ln2": SequenceParallel(),
        f"{prefix}mlp": gather,
        f"{prefix}mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def gpt_plan(model: GPTModel, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Every block's plan; with SP, the cut of the residual stream before the first block and
    its gather before the final LayerNorm (local tensors in between)."""
    plan: dict[str, ParallelStyle] = {}
    for index in model.layers:
        plan |= block_plan(f"layers.{index}.", sequence_parallel=sequence_parallel)
    if sequence_parallel:
        first = next(iter(model.layers))
        plan[f"layers.{first}"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        plan["ln_f"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def check_plan(model: nn.Module, plan: dict[str, ParallelStyle], tp: int) -> None:
    """Refuse, before any compute, a plan that shards a dimension ``tp`` does not divide (DTensor
    would split it unevenly, ``torch.chunk``'s way, and heads would straddle two ranks)."""
    errors = []
    for path, style in plan.items():
        dim = {ColwiseParallel: 0, RowwiseParallel: 1}.get(type(style))
        if dim is None:
            continue
        weight = model.get_submodule(path).weight
        if weight.shape[dim] % tp:
            errors.append(
                f"{type(style).__name__} on {path} shards weight dim {dim} of size {weight.shape[dim]} "
                f"over tp {tp} ({weight.shape[dim]} % {tp} = {weight.shape[dim] % tp})"
            )
    if errors:
        raise ValueError("; ".join(errors) + ": choose a tensor-parallel size that divides them")


def as_nn_linear(model: GPTModel) -> None:
    """Swap each block's unsharded (tp = 1) Column/RowParallelLinear for an ``nn.Linear`` holding
    the same parameters: the layer type ``ColwiseParallel`` and ``RowwiseParallel`` shard."""
    for name, module in list(model.named_modules()):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if module.group is not None:
                raise ValueError(f"{name} is already split by hand: build the model with tp = 1")
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight, linear.bias = module.weight, module.bias  # (out, in), (out,): initialised
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, linear)


def parallelize(
    model: GPTModel,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    plan: dict[str, ParallelStyle] | None = None,
) -> dict[str, ParallelStyle]:
    """Apply ``plan`` (default :func:`gpt_plan`) to an unsharded model over the 1-D ``tp_mesh``,
    in place; returns the plan. With tp = 1 the model is left as it is."""
    if tp_mesh.size() == 1:
        return {}
    as_nn_linear(model)
    plan = gpt_plan(model, sequence_parallel=sequence_parallel) if plan is None else plan
    check_plan(model, plan, tp_mesh.size())
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():  # SP: the residual stream is this rank's T / p positions,
        block.sequence_parallel = sequence_parallel  # dropped out from the model-parallel stream
    return plan


def local_numel(model: nn.Module) -> int:
    """The values this rank holds: a DTensor parameter's local shard, a plain one whole."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())


@torch.no_grad()
def reduce_partial_gradients(params: Iterable[nn.Parameter]) -> None:
    """Make every ``Partial`` gradient whole (all-reduce over its mesh dimensions): the norms
    under SP, whose tp ranks each saw T / p tokens. Megatron-LM all-reduces them by hand."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(
                placements=[Replicate() if pl.is_partial() else pl for pl in g.placements]
            )


def describe_mesh(mesh: DeviceMesh) -> str:
    """The start-up line: the mesh's dimensions and which global rank sits where."""
    shape = " x ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    return f"> DeviceMesh {shape} ({mesh.device_type}), ranks by (pp, dp, tp): {mesh.mesh.tolist()}"


def describe_plan(plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh) -> str:
    """The start-up line: which style each kind of module got (block prefixes folded)."""
    by_style: dict[str, list[str]] = {}
    for path, style in plan.items():
        parts = path.split(".")
        leaf = ".".join(parts[2:]) if parts[0] == "layers" and len(parts) > 2 else path
        names = by_style.setdefault(type(style).__name__, [])
        if leaf not in names:
            names.append(leaf)
    styles = "; ".join(f"{name} on {', '.join(paths)}" for name, paths in by_style.items())
    return f"> DTensor tensor parallelism: parallelize_module over mesh['tp'] of {tp_mesh.size()} ranks: {styles}"
