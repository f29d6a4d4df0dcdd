"""Activation memory of one transformer layer per rank, measured, against the estimator and Korthikanti.

What a layer keeps from forward to backward is exactly what autograd saves: every distinct
storage that passes through ``torch.autograd.graph.saved_tensors_hooks`` during the layer's
forward (custom autograd functions included), less the parameters and autocast's half copies of
them (model states, not activations). :func:`saved_activation_bytes` counts them, so the number
is the same on a CPU and a GPU and is free of allocator caching and of gloo's buffers.

Run under a launcher with ``tp`` ranks (``srun -n 2`` or ``torchrun --nproc-per-node 2``)::

    python -m distlab.gpt.memory.activation_memory --seq-lengths 128 256 512

Each rank measures one block at tensor-parallel size ``tp`` with and without sequence
parallelism, for every sequence length, split by this engine's layers (notebook 05) or, with
``--tensor-parallel-impl dtensor``, by DTensor's plan (``dtensor_parallel.block_plan``, notebook 08;
a saved DTensor counts its local shard), and prints one line per measurement (:data:`LINE`):
measured bytes, ``memory_estimate.block_bytes`` (this engine's terms) and Korthikanti's half
precision formula, sbh (10 + 24/t + 5as/(ht)) with TP alone, sbh/t (34 + 5as/h) with SP.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from distlab.distributed import init_distributed, shutdown
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import MemorySetup, block_bytes, korthikanti_layer_bytes
from distlab.gpt.native.dtensor_parallel import IMPLEMENTATIONS, as_nn_linear, block_plan
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import init_parameters
from distlab.gpt.transformer.transformer_layer import Block

LINE = (
    "activations per layer: rank {rank} tp {tp} sequence-parallel {sp} s {s} b {b} h {h} a {a}: "
    "measured {measured:.0f} B, estimated {estimated:.0f} B, Korthikanti {korthikanti:.0f} B"
)
_PATTERN = re.compile(
    r"activations per layer: rank (?P<rank>\d+) tp (?P<tp>\d+) sequence-parallel (?P<sp>True|False) "
    r"s (?P<s>\d+) b (?P<b>\d+) h (?P<h>\d+) a (?P<a>\d+): measured (?P<measured>\d+) B, "
    r"estimated (?P<estimated>\d+) B, Korthikanti (?P<korthikanti>\d+) B"
)


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The memory ``t`` lives in: a DTensor's is its local shard's."""
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


def _is_weight_copy(t: torch.Tensor, weights: set[int]) -> bool:
    """autocast's cast of a parameter (or its transpose, which a GEMM saves): a chain of
    ``ToCopyBackward`` / ``TBackward`` that starts at a parameter's leaf."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in ("ToCopyBackward0", "TBackward0"):
        fn = fn.next_functions[0][0]
        if type(fn).__name__ == "AccumulateGrad":
            return _storage(fn.variable).data_ptr() in weights
    return False


def saved_activation_bytes(forward: Callable[[], torch.Tensor], params: list[nn.Parameter]) -> int:
    """Bytes of the distinct storages autograd saves while ``forward()`` runs, less ``params``
    and autocast's copies of them."""
    weights = {_storage(p).data_ptr() for p in params}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage.data_ptr() not in weights and not _is_weight_copy(t, weights):
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(kept.values())


def measure_block(
    state: ParallelState,
    *,
    s: int,
    b: int,
    h: int,
    a: int,
    precision: str,
    attention_backend: str,
    device: torch.device | None = None,
    tensor_parallel_impl: str = "megatron",
    fp32_residual_connection: bool = False,
) -> dict:
    """One block of this rank's tp shard (sequence-parallel as ``state.layout`` says), split by the
    engine's layers or by DTensor's plan (``tensor_parallel_impl``), its input in the residual
    stream's dtype (fp32, or the half ``precision`` without ``fp32_residual_connection``):
    measured, estimated and Korthikanti's bytes."""
    sp, tp = state.layout.sequence_parallel, state.tp
    dtensor = tensor_parallel_impl == "dtensor"
    cfg = GPTConfig(1, h, a, 128, s, attention_backend=attention_backend, sequence_parallel=sp and not dtensor,
                    fp32_residual_connection=fp32_residual_connection)  # fmt: skip
    block = Block(cfg, state.tp_group if tp > 1 and not dtensor else None)
    init_parameters(block, cfg, None if dtensor else state)
    block.to(device)
    if dtensor:  # built whole, then split by the plan over a 1-D mesh of the tp ranks
        as_nn_linear(block)
        mesh = init_device_mesh((device or torch.device("cpu")).type, (tp,), mesh_dim_names=("tp",))
        parallelize_module(block, mesh, block_plan("", sequence_parallel=sp))
    half = precision in ("fp16", "bf16")
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    residual = dtype if half and not fp32_residual_connection else torch.float32
    x = torch.randn(
        b, s // tp if sp else s, h, device=device, dtype=residual, requires_grad=True
    )  # (b, T, H), or (b, T/tp, H) with SP

    def forward() -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=dtype, enabled=half):
            return block(x)

    setup = MemorySetup(1, h, a, s, 128, b, precision=precision, attention_backend=attention_backend, tp=tp,
                        sequence_parallel=sp, tensor_parallel_impl=tensor_parallel_impl,
                        fp32_residual_connection=fp32_residual_connection)  # fmt: skip
    return dict(rank=state.rank, tp=tp, sp=sp, s=s, b=b, h=h, a=a,
                measured=saved_activation_bytes(forward, list(block.parameters())),
                estimated=block_bytes(setup),
                korthikanti=korthikanti_layer_bytes(s, b, h, a, tp, sequence_parallel=sp))  # fmt: skip


def parse(log: str) -> list[dict]:
    """The :data:`LINE` s of a log, as dicts (numbers as int, ``sp`` as bool)."""
    rows = []
    for m in _PATTERN.finditer(log):
        row = {k: int(v) for k, v in m.groupdict().items() if k != "sp"}
        rows.append({**row, "sp": m["sp"] == "True"})
    return rows


def plot(rows: list[dict], rank: int = 0):
    """Bytes per layer on ``rank`` against the sequence length: measured (dots), this engine's
    estimate (dashed) and Korthikanti's formula (solid), TP alone and TP + SP."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for sp, color in ((False, "tab:blue"), (True, "tab:orange")):
        mine = sorted((r for r in rows if r["rank"] == rank and r["sp"] == sp), key=lambda r: r["s"])
        if not mine:
            continue
        s, tp = [r["s"] for r in mine], mine[0]["tp"]
        name = f"TP {tp}" + (" + SP" if sp else "")
        ax.plot(s, [r["korthikanti"] / 2**20 for r in mine], "-", color=color, label=f"{name}: Korthikanti")
        ax.plot(s, [r["estimated"] / 2**20 for r in mine], "--", color=color, label=f"{name}: estimator")
        ax.plot(s, [r["measured"] / 2**20 for r in mine], "o", color=color, label=f"{name}: measured")
    ax.set(xlabel="sequence length s", ylabel=f"MiB per layer on rank {rank}",
           title="activations kept for backward, one layer")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="bf16")
    parser.add_argument(
        "--attention-backend", default="unfused", help="unfused keeps the scores, as Korthikanti"
    )
    parser.add_argument(
        "--tensor-parallel-impl", choices=IMPLEMENTATIONS, default="megatron",
        help="whose split: this engine's layers or DTensor's plan",
    )  # fmt: skip
    args = parser.parse_args(argv)
    ctx = init_distributed()
    try:
        for sp in (False, True):
            state = ParallelState.build(Layout(ctx.world_size, tp=ctx.world_size, sequence_parallel=sp))
            for s in args.seq_lengths:
                row = measure_block(state, s=s, b=args.micro_batch_size, h=args.hidden_size,
                                    a=args.num_attention_heads, precision=args.precision,
                                    attention_backend=args.attention_backend, device=ctx.device,
                                    tensor_parallel_impl=args.tensor_parallel_impl)  # fmt: skip
                print(LINE.format(**row), flush=True)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
