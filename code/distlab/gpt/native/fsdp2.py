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
fp32 into fp32 shards, which the optimizer updates (the master weights). The residual stream is
bf16 too, unless ``--fp32-residual-connection``: then the blocks' inputs are not cast
(``cast_forward_inputs=False``) and stay fp32 from the embeddings on. ``CPUOffloadPolicy``:
shards, their gradients and the optimizer state stay on the CPU, where the optimizer steps; each
all-gather first copies a unit's shards to the device.

Megatron-LM's ``--use-torch-fsdp2`` (``TorchFullyShardedDataParallel``) shards the same way. With
``--tensor-parallel-impl dtensor`` the blocks' linear weights are already DTensors on
``mesh["tp"]`` (``dtensor_parallel.py``): ``fully_shard`` over ``mesh["dp"]`` then shards them on
the 2-D (dp, tp) mesh as well, torchtitan's FSDP x TP. Its refusals (pipeline parallelism, the
hand-written TP, --fp16, --deepspeed, --save/--load in the legacy format: sharded states need
``--ckpt-format torch_dist``, ``checkpointing/dist_checkpointing.py``) are checked with the other
arguments, in ``arguments/backends.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from distlab.gpt.interfaces import StepOutcome, mean_backward
from distlab.gpt.native.dtensor_parallel import reduce_partial_gradients
from distlab.gpt.optimizer.optimizer import step_unless
from distlab.gpt.optimizer.precision import Precision
from distlab.gpt.transformer.gpt_model import GPTModel

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
    cast_forward_inputs: bool = True
    """Cast each unit's floating-point inputs to ``param_dtype``; False with
    ``--fp32-residual-connection``, so that the blocks receive the fp32 residual stream."""

    @classmethod
    def from_args(cls, args: PretrainArgs) -> FSDP2Config:
        half = (torch.bfloat16, torch.float32) if args.bf16 else (None, None)
        return cls(args.torch_fsdp2_reshard_after_forward, *half, cpu_offload=args.torch_fsdp2_cpu_offload,
                   cast_forward_inputs=not args.fp32_residual_connection)  # fmt: skip

    def mp_policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            cast_forward_inputs=self.cast_forward_inputs,
        )

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
        f"autocast), fp32 sharded master weights and optimizer, fp32 reduce-scatter, no loss scaling, "
        f"{precision.residual_clause()}"
    )


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
def grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """``||g|| = sqrt(sum_p ||g_p||^2)`` from each rank's local pieces: a DTensor gradient's squared
    norm is summed over the mesh dimensions it is sharded on (FSDP's dp, a TP weight's tp), counted
    once along those it is replicated on; a plain tensor is the same on every rank. The number
    ``torch.nn.utils.get_total_norm`` gives for one mesh, for any mix of meshes (FSDP2 x TP puts
    the blocks' linear weights on the 2-D mesh, the rest on dp), reduced on the mesh's device even
    when CPUOffloadPolicy keeps the shards on the CPU. Gradients must not be ``Partial``
    (``dtensor_parallel.reduce_partial_gradients``)."""
    plain: list[torch.Tensor] = []
    pieces: dict[tuple, list[torch.Tensor]] = {}  # (mesh, sharded mesh dims) -> local shards
    for p in params:
        if p.grad is None:
            continue
        if not isinstance(p.grad, DTensor):
            plain.append(p.grad)
            continue
        mesh = p.grad.device_mesh
        # sharded: Shard, and FSDP2 x TP's _StridedShard (whose is_shard() is False)
        dims = tuple(
            i for i, pl in enumerate(p.grad.placements) if not (pl.is_replicate() or pl.is_partial())
        )
        pieces.setdefault((mesh, dims), []).append(p.grad.to_local())
    total = torch.nn.utils.get_total_norm(plain).float() ** 2 if plain else torch.zeros(())
    for (mesh, dims), shards in pieces.items():  # the same keys, in the same order, on every rank
        part = (torch.nn.utils.get_total_norm(shards).float() ** 2).to(mesh.device_type)
        for dim in dims:
            dist.all_reduce(part, group=mesh.get_group(dim))
        total = total.to(part.device) + part
    return total.sqrt()


class FSDP2Backend:
    """The step of a model whose parameters are DTensors (``interfaces.StepBackend``): FSDP2,
    DTensor TP (``dtensor_parallel.py``) or both. Plain backward (FSDP's hooks reduce-scatter,
    DTensor's autograd runs TP's collectives), Partial gradients made whole, the global norm
    over the shards, clipping, the run's optimizer on the shards.

    Under FSDP, micro-batches ``0 .. m - 2`` run with ``set_requires_gradient_sync(False)``
    (:meth:`set_grad_sync`, which the schedule calls before each backward): their
    full gradients accumulate unsharded (in fp32 under the bf16 policy), and the last one
    reduce-scatters their sum, once per block and step: each rank keeps its rows of the mean over
    the dp ranks (FSDP2's default divides the reduced sum by dp). DTensor TP alone has dp = 1
    (``arguments/backends.py``).
    """

    def __init__(self, model: GPTModel, optimizer: torch.optim.Optimizer, *, clip_grad: float) -> None:
        self.module, self.optimizer, self.clip_grad = model, optimizer, clip_grad
        self.fsdp = isinstance(model, FSDPModule)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def set_grad_sync(self, enabled: bool) -> None:
        if self.fsdp:
            self.module.set_requires_gradient_sync(enabled)

    def backward(self, loss: torch.Tensor, k: int, m: int) -> None:
        mean_backward(loss, k, m)  # loss_k / m

    def step(self) -> StepOutcome:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        reduce_partial_gradients(params)  # SP's norms: all-reduce over tp
        norm = grad_norm(params)
        nonfinite = ~torch.isfinite(norm)  # then no clipping, no update (as the local back end)
        if self.clip_grad > 0:
            # g x min(1, clip / ||g||), one tensor at a time: DTensor TP leaves the embeddings plain;
            # a norm of 0 in place of a non-finite one makes the factor 1 (gradients left alone)
            finite_norm = torch.where(nonfinite, torch.zeros_like(norm), norm)
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad, finite_norm, foreach=False)
        step_unless(self.optimizer, nonfinite)  # decided on the device (fused optimizer)
        return StepOutcome(norm, skipped=nonfinite, nonfinite=nonfinite)

    def close(self) -> None:
        pass
