"""Try a DTensor plan for the MLP on 2 spawned gloo ranks: losses and collectives against one process.

``try_mlp_plan({"fc1": ..., "fc2": ...})`` builds the course's tiny GPT (2 blocks), parallelizes
attention with the reference plan (``dtensor_parallel.block_plan``) and each block's MLP with the
given styles, trains ``steps`` AdamW steps on fixed tokens, and returns::

    {"losses": [...], "reference": [...]   every step's loss, TP 2 and one process (same weights)
     "collectives": {"all_reduce": 4}      block 1's forward + backward, by kind (CommDebugMode)
     "error": None or "..."}               what PyTorch said when the plan did not run

A right plan gives the reference's losses (within 1e-6) and Megatron's 4 all-reduces per block.
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.distributed.tensor.parallel import ParallelStyle

from distlab.distributed import init_distributed, shutdown
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_ranks import free_port, torchrun_env

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=128, max_position_embeddings=16)
B, T = 2, 16  # micro batch, sequence


def _train(model: torch.nn.Module, steps: int) -> list[float]:
    tokens = torch.randint(0, CONFIG["vocab_size"], (B, T + 1), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()  # (b, T) per-token losses -> mean
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


#: c10d's operator names (after the suffixes are cut) -> the functional collectives' names.
_KINDS = {
    "allreduce": "all_reduce",
    "_allgather_base": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
}


def block_collectives(block: torch.nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Collectives of one block's forward and backward on ``x`` (b, T, H), by kind
    (``all_reduce``, ``all_gather``, ``reduce_scatter``): DTensor's functional ones and the
    process group's own (the hand-written TP's ``c10d::allreduce_``) alike."""
    from torch.distributed.tensor.debug import CommDebugMode

    x = x.detach().requires_grad_()
    with CommDebugMode() as comm:
        block(x).sum().backward()
    counts: dict[str, int] = {}
    for op, n in comm.get_comm_counts().items():
        name = str(op).split(".")[-1].removesuffix("_").removesuffix("_into_tensor").removesuffix("_tensor")
        kind = _KINDS.get(name, name)
        counts[kind] = counts.get(kind, 0) + n
    return counts


def _rank(rank: int, port: int, mlp_plan: dict[str, ParallelStyle], steps: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from distlab.gpt.native.dtensor_parallel import as_nn_linear, block_plan, check_plan

    os.environ.update(torchrun_env(rank, 2, port))
    torch.set_num_threads(1)  # the two ranks share the notebook's cores
    init_distributed("gloo")
    result: dict = {"error": None}
    try:
        model = GPTModel(GPTConfig(**CONFIG))
        as_nn_linear(model)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        plan: dict[str, ParallelStyle] = {}
        for i in model.layers:
            attention = block_plan(f"layers.{i}.", sequence_parallel=False)
            plan |= {k: v for k, v in attention.items() if ".attn." in k}
            plan |= {f"layers.{i}.mlp.{name}": style for name, style in mlp_plan.items()}
        check_plan(model, plan, 2)
        parallelize_module(model, mesh, plan)
        result["losses"] = _train(model, steps)
        result["collectives"] = block_collectives(model.layers["1"], torch.randn(B, T, CONFIG["hidden_size"]))
    except Exception as exc:  # noqa: BLE001 - the learner's plan may fail anywhere; report it
        result["error"] = "".join(traceback.format_exception_only(exc)).strip()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown()


def try_mlp_plan(mlp_plan: dict[str, ParallelStyle], steps: int = 3) -> dict:
    """Train with ``mlp_plan`` on 2 gloo ranks and with one process; see the module docstring."""
    reference = _train(GPTModel(GPTConfig(**CONFIG)), steps)
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(free_port(), mlp_plan, steps, out), nprocs=2, join=True)
        result = json.loads(Path(out, "rank0.json").read_text())
    return {"losses": result.get("losses"), "reference": reference, **result}


def plan_is_right(result: dict) -> bool:
    """Losses within 1e-6 of one process and 4 all-reduces per block (Megatron's f and g)."""
    if result["error"] or result["losses"] is None:
        return False
    close = torch.allclose(
        torch.tensor(result["losses"]), torch.tensor(result["reference"]), rtol=1e-6, atol=0
    )
    return close and result["collectives"] == {"all_reduce": 4}


def what_is_wrong(result: dict) -> str:
    """Why :func:`plan_is_right` refused ``result``, in words ("" when it did not)."""
    if result["error"] or result["losses"] is None:
        return (
            f"PyTorch could not run it ({result['error']}): the layouts of fc1's output and fc2's input "
            "must agree; which layer is split by columns, which by rows?"
        )
    if not torch.allclose(
        torch.tensor(result["losses"]), torch.tensor(result["reference"]), rtol=1e-6, atol=0
    ):
        return f"its losses {result['losses']} are not one process's {result['reference']} (within 1e-6)"
    if result["collectives"] != {"all_reduce": 4}:
        return (
            f"block 1 ran {result['collectives']} where Megatron's runs {{'all_reduce': 4}} (f and g of the "
            "attention and of the MLP): the MLP must not communicate between fc1 and fc2"
        )
    return ""
