"""PyTorch's FSDP2 for the course's GPT: ``fully_shard`` on every block, then on the root.

FSDP2 is ZeRO-3 (Rajbhandari et al. 2020) written with DTensors. Every parameter ``W`` (n rows)
becomes a DTensor placed ``Shard(0)`` on a 1-D DeviceMesh of the dp ranks: rank r keeps rows
``[r ceil(n / dp), (r + 1) ceil(n / dp))`` (``torch.chunk``'s split). With P parameters in fp32
and Adam (8 bytes of state per parameter), a rank holds::

    parameters 4P / dp + gradients 4P / dp + optimizer state 8P / dp     (16P without sharding)

plus the full parameters of the unit that runs. A unit is one ``fully_shard`` call: each block,
then the root, the embeddings and the final LayerNorm (E, tied to the output layer, is used at
both ends of the forward; the root keeps its gathered parameters from forward to backward, FSDP2's
default for it, as the backward needs them first)::

    forward of block l    all-gather W_l from the dp shards; compute; free W_l
    backward of block l   all-gather W_l again; dW_l; reduce-scatter: rank r keeps its rows of
                          (1 / dp) sum_r' dW_l(r'), the gradient of the global batch's mean loss
    step                  the optimizer updates this rank's rows only (its state has their shape)

``reshard_after_forward=False`` keeps each block's gathered W_l from its forward to its backward:
one all-gather per block and micro-batch instead of two, for the full parameters held in between
(ZeRO-2's parameter memory, ZeRO-3's gradient and optimizer shards). ``MixedPrecisionPolicy
(param_dtype=bf16, reduce_dtype=fp32)`` (``--bf16``): the all-gather casts the fp32 shards to
bf16, forward and backward compute in bf16 (no autocast), the gradients are reduce-scattered in
fp32 into fp32 shards, which the optimizer updates (the master weights). ``CPUOffloadPolicy``:
shards, their gradients and the optimizer state stay on the CPU, where the optimizer steps; each
all-gather first copies a unit's shards to the device.

Megatron-LM's ``--use-torch-fsdp2`` (``TorchFullyShardedDataParallel``) shards the same way. Its
refusals (tensor or pipeline parallelism, --fp16, --deepspeed, --save/--load in the legacy format:
sharded states need ``--ckpt-format torch_dist``, ``dist_checkpointing.py``) are checked with the
other arguments, in ``arguments.py``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from distlab.gpt.interfaces import StepOutcome, mean_backward
from distlab.gpt.layout import Layout
from distlab.gpt.model import GPTModel
from distlab.gpt.precision import Precision

if TYPE_CHECKING:
    from distlab.gpt.arguments import PretrainArgs


@dataclass(frozen=True)
class FSDP2Config:
    """What ``fully_shard`` is given, from ``--use-torch-fsdp2``'s flags and the precision."""

    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (``--torch-fsdp2-reshard-after-forward``)."""
    param_dtype: torch.dtype | None = None
    """bf16 with ``--bf16``: what the all-gather casts to and the forward computes in; None: fp32."""
    reduce_dtype: torch.dtype | None = None
    """fp32 with ``--bf16``: what the gradients are reduce-scattered and kept in."""
    cpu_offload: bool = False
    """``CPUOffloadPolicy`` (``--torch-fsdp2-cpu-offload``)."""

    @classmethod
    def from_args(cls, args: PretrainArgs) -> FSDP2Config:
        half = (torch.bfloat16, torch.float32) if args.bf16 else (None, None)
        return cls(args.torch_fsdp2_reshard_after_forward, *half, cpu_offload=args.torch_fsdp2_cpu_offload)

    def mp_policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def offload_policy(self, device: torch.device) -> OffloadPolicy:
        if not self.cpu_offload:
            return OffloadPolicy()  # none
        return CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinned pages: async copies

    def describe(self, mesh: DeviceMesh, num_blocks: int) -> str:
        """The start-up line: what was sharded, over which mesh, with which policies."""
        mp = "fp32 throughout"
        if self.param_dtype is not None:
            mp = f"MixedPrecisionPolicy(param_dtype={_short(self.param_dtype)}, reduce_dtype={_short(self.reduce_dtype)})"
        return (
            f"> torch FSDP2: fully_shard on each of {num_blocks} blocks, then the root, over a 1-D "
            f"DeviceMesh of {mesh.size()} data-parallel ranks ({mesh.device_type}); reshard_after_forward="
            f"{self.reshard_after_forward} for the blocks; {mp}; CPUOffloadPolicy {'on' if self.cpu_offload else 'off'}"
        )


def _short(dtype: torch.dtype | None) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", None: "None"}.get(dtype, str(dtype))


def precision_line(precision: Precision, device: torch.device) -> str:
    """``Precision.describe`` under FSDP2: with --bf16 the policy, not autocast, casts."""
    if precision.name != "bf16":
        return precision.describe(device)
    return (
        f"precision: bf16 parameters and compute on {device.type} (FSDP2's MixedPrecisionPolicy, no "
        f"autocast), fp32 sharded master weights and optimizer, fp32 reduce-scatter, no loss scaling"
    )


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The 1-D mesh of the data-parallel ranks (with tp = pp = 1, every rank, in rank order)."""
    if layout.tp != 1 or layout.pp != 1:  # validate_args refuses it first; this guards other callers
        raise ValueError(
            f"FSDP2 here shards over data-parallel ranks only: --tensor-model-parallel-size {layout.tp} "
            f"and --pipeline-model-parallel-size {layout.pp} must both be 1"
        )
    return init_device_mesh(device.type, (layout.dp,), mesh_dim_names=("dp",))


def shard_model(model: GPTModel, mesh: DeviceMesh, config: FSDP2Config, device: torch.device) -> None:
    """``fully_shard`` each block, then the root: the parameters become ``Shard(0)`` DTensors.

    In place (``model``'s class becomes FSDP's subclass of it); build the optimizer after, on the
    sharded parameters."""
    kwargs = dict(mesh=mesh, mp_policy=config.mp_policy(), offload_policy=config.offload_policy(device))
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=config.reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)  # the rest (embeddings, final LayerNorm); not resharded after forward
    # The root returns the per-token loss, a view (b, T) that the step only reads (.mean()), never
    # changes in place, which FSDP2 warns about on every forward.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPTModel\) returned a view")


@torch.no_grad()
def grad_norm(params: Iterable[nn.Parameter], mesh: DeviceMesh) -> torch.Tensor:
    """``||g|| = sqrt(sum_r sum_p ||g_p(r)||^2)``: each rank's rows of every gradient, summed over
    the mesh. The same number as ``torch.nn.utils.get_total_norm`` of the DTensor gradients, but
    reduced on the mesh's device even when CPUOffloadPolicy keeps the shards on the CPU."""
    shards = [p.grad.to_local() for p in params if p.grad is not None]  # this rank's rows
    local = torch.nn.utils.get_total_norm(shards).float() ** 2 if shards else torch.zeros(())
    total = local.to(mesh.device_type)
    dist.all_reduce(total, group=mesh.get_group())
    return total.sqrt()


class FSDP2Backend:
    """FSDP2's step (``interfaces.StepBackend``): plain backward, reduce-scatter by FSDP's hooks,
    the global norm over the shards, clipping, the run's optimizer on the shards.

    Micro-batches ``0 .. m - 2`` run with ``set_requires_gradient_sync(False)``: their full
    gradients accumulate unsharded (in fp32 under the bf16 policy), and the last one
    reduce-scatters the sum, once per block and step.
    """

    def __init__(
        self, model: GPTModel, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, *, clip_grad: float
    ) -> None:
        self.module, self.optimizer, self.mesh, self.clip_grad = model, optimizer, mesh, clip_grad

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, k: int, m: int) -> None:
        self.module.set_requires_gradient_sync(k == m - 1)
        mean_backward(loss, k, m)  # loss_k / m

    def step(self) -> StepOutcome:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        norm = grad_norm(params, self.mesh)
        value = float(norm)
        if not math.isfinite(value):  # no clipping, no update (as the local back end without fp16)
            return StepOutcome(value, skipped=True, nonfinite=True)
        if self.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad, norm)  # g x min(1, clip / ||g||)
        self.optimizer.step()
        return StepOutcome(value, skipped=False)

    def close(self) -> None:
        pass
