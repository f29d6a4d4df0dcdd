"""Megatron's distributed optimizer (ZeRO-1, ``--use-distributed-optimizer``): fp32 main
parameters and Adam's moments sharded over the dp x cp ranks.

Contract: the same update as the plain optimizer on the whole model, computed by each of the
``d = dp x cp`` ranks on its shard of every bucket (``param_and_grad_buffer.py``); Adam is
element-wise, so shards change nothing but where each element is updated::

    finish_grad_sync    shard of main_grad = mean gradient         (reduce-scatter per bucket)
    norm                ||g||^2 = sum over dp x cp shards (then tp, pp) of the counted elements
    step                AdamW on the fp32 main shard; param shard <- main shard (cast)
    start_param_sync    whole parameters again                     (all-gather per bucket)

Bytes per parameter per rank (Megatron's ``dist_optimizer.md`` table)::

    bf16 parameters    2 (param) + 4 (fp32 grad) + (4 main + 4 + 4 moments) / d  =  6 + 12 / d
    fp32 parameters    4 (param) + 4 (fp32 grad) + (4 + 4 moments) / d          =  8 +  8 / d

against 18 and 16 without (d = 1). With fp32 parameters the main parameter is the parameter's own
shard (a view); with bf16 the model's weights are bf16 and the fp32 main copy lives here only.
Padding (at most d - 1 elements per bucket) is in the buffers but has no moments.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.distributed.grad_buckets import default_bucket_size
from distlab.gpt.distributed.gradients import Gradients, clip_gradients, counted_in_norm, square_sum
from distlab.gpt.distributed.param_and_grad_buffer import ParamAndGradBuffer
from distlab.gpt.optimizer.loss_scaler import unscale_and_check
from distlab.gpt.optimizer.optimizer import decays, make_optimizer
from distlab.gpt.parallel_state import ParallelState


class DistributedOptimizer:
    """``make(groups)`` (a torch optimizer over parameter groups) on the main-parameter shards.

    ``decays(p)`` says whether ``p`` has weight decay (the group layout of ``build_optimizer``)."""

    def __init__(self, buffer: ParamAndGradBuffer, state: ParallelState, make, decays) -> None:
        self.buffer, self.state = buffer, state
        self.main, self.pieces = [], []  # per bucket: fp32 (S,) shard; [(param, piece, lo, hi)]
        groups = ([], [])
        for bucket in buffer.buckets:
            shard = bucket.param_shard()
            main = shard if shard.dtype == torch.float32 else shard.float()  # (S,)
            self.main.append(main)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                lo, hi = max(offset, bucket.start), min(offset + p.numel(), bucket.end)
                if lo >= hi:
                    continue  # no element of p in this rank's shard
                piece = nn.Parameter(main[lo - bucket.start : hi - bucket.start])  # a leaf view of main
                piece.grad = bucket.grad_shard()[lo - bucket.start : hi - bucket.start]
                self.pieces.append((p, piece, lo - offset, hi - offset))
                groups[0 if decays(p) else 1].append(piece)
        self.optimizer = make(groups)
        adam = isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW)
        self.moment_keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def optim_state(self) -> dict:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # the fp32 gradient buffer is kept and zeroed, as Megatron's
        self.buffer.zero_grad()

    def shard_grads(self, counted=lambda p: True) -> list[torch.Tensor]:
        """This rank's pieces of the averaged gradients (of the parameters ``counted`` keeps)."""
        return [piece.grad for p, piece, _, _ in self.pieces if counted(p)]

    @torch.no_grad()
    def finalize_gradients(
        self, tied_weight: torch.Tensor | None, *, loss_scale: float | None, clip_grad: float
    ) -> Gradients:
        """``gradients.finalize_gradients``'s steps on the shards: the tied embedding's two stages
        summed (whole, before its bucket's reduce-scatter), the reduce-scatters, the
        sequence-parallel sum over tp (the tp ranks' buffers have one layout), fp16's unscale, the
        norm (the shards' squares summed over dp x cp, then tp and pp) and clipping."""
        state = self.state
        if tied_weight is not None and state.embedding_group is not None:
            dist.all_reduce(tied_weight.main_grad, group=state.embedding_group)
        self.buffer.finish_grad_sync()
        if state.layout.sequence_parallel:
            sp = self.shard_grads(lambda p: getattr(p, "sequence_parallel", False))
            if sp:
                flat = torch.cat(sp)  # one message
                dist.all_reduce(flat, group=state.tp_group)
                torch._foreach_copy_(sp, list(flat.split([g.numel() for g in sp])))
        pieces = [piece for _, piece, _, _ in self.pieces]
        if loss_scale is not None and unscale_and_check(pieces, loss_scale):
            return Gradients(None, overflow=True)
        total = square_sum(self.shard_grads(lambda p: counted_in_norm(p, state.tp_rank, state.pp)))
        for group, size in ((state.dp_cp_group, state.dp * state.cp), (state.tp_group, state.tp),
                            (state.pp_group, state.pp)):  # fmt: skip
            if size > 1:
                dist.all_reduce(total, group=group)
        norm = total.sqrt()
        if torch.isfinite(norm):
            clip_gradients(pieces, clip_grad, norm)
        return Gradients(float(norm))

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        for bucket, main in zip(self.buffer.buckets, self.main, strict=True):
            if main.data_ptr() != bucket.param_shard().data_ptr():
                bucket.param_shard().copy_(main)  # fp32 main -> bf16 parameter shard
        self.buffer.start_param_sync()

    # -- checkpoints: whole per-bucket tensors, so that any dp x cp can load them ---------------

    def bucket_tensors(self, i: int) -> dict[str, torch.Tensor]:
        """This rank's shard of bucket ``i``: main parameters and moments, (S,) fp32 each."""
        main = self.main[i]
        out = {"param": main, **{k: torch.zeros_like(main) for k in self.moment_keys}}
        start = self.buffer.buckets[i].start
        for p, piece, lo, hi in self.pieces:
            if self.buffer.bucket_of[p] != i:
                continue
            at = self.buffer.buckets[i].offsets[self.buffer.buckets[i].params.index(p)] + lo - start
            for key, value in self.optimizer.state.get(piece, {}).items():
                if key in self.moment_keys and value is not None:
                    out[key][at : at + hi - lo] = value
        return out

    def load_bucket_tensors(self, i: int, tensors: dict[str, torch.Tensor], step: torch.Tensor) -> None:
        """Inverse of :meth:`bucket_tensors`; the parameters' shards and then all-gathers follow."""
        self.main[i].copy_(tensors["param"])
        start = self.buffer.buckets[i].start
        for p, piece, lo, hi in self.pieces:
            if self.buffer.bucket_of[p] != i:
                continue
            at = self.buffer.buckets[i].offsets[self.buffer.buckets[i].params.index(p)] + lo - start
            self.optimizer.state[piece] = {
                "step": step.clone(),
                **{k: tensors[k][at : at + hi - lo].clone() for k in self.moment_keys},
            }
        bucket = self.buffer.buckets[i]
        bucket.param_shard().copy_(self.main[i])
        self.buffer.pending = set(range(len(self.buffer.buckets)))
        self.buffer.finish_param_sync()

    def step_count(self) -> torch.Tensor:
        states = [s["step"] for s in self.optimizer.state.values() if "step" in s]
        return states[0] if states else torch.zeros(())

    def state_bytes(self) -> int:
        """This rank's optimizer-state bytes: main copies kept here (bf16 only) and moments."""
        own = sum(m.numel() * 4 for m, b in zip(self.main, self.buffer.buckets, strict=True)
                  if m.data_ptr() != b.param_shard().data_ptr())  # fmt: skip
        moments = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                      for k, t in s.items() if k != "step")  # fmt: skip
        return own + moments


def build_distributed_optimizer(
    model: nn.Module, state: ParallelState, args: PretrainArgs, dtype: torch.dtype
) -> DistributedOptimizer:
    """The buffers (parameters cast to ``dtype``) and the optimizer on their shards, with
    ``--ddp-bucket-size``, ``--overlap-grad-reduce`` and ``--overlap-param-gather``."""
    names = {p: name for name, p in model.named_parameters()}
    size = args.ddp_bucket_size or default_bucket_size(state.dp * state.cp)
    buffer = ParamAndGradBuffer(
        list(model.parameters()),
        state,
        bucket_size=size,
        dtype=dtype,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        hold=model.tied_embedding() if state.embedding_group is not None else None,
    )
    if args.overlap_param_gather:
        buffer.register_forward_pre_hooks(model)
    return DistributedOptimizer(buffer, state, lambda g: make_optimizer(g, args), lambda p: decays(names[p]))


def bytes_per_parameter(dtype: torch.dtype, d: int) -> float:
    """Megatron's table: bf16/fp16 parameters with fp32 gradients ``6 + 12 / d``, fp32 ``8 + 8 / d``."""
    return 6 + 12 / d if dtype != torch.float32 else 8 + 8 / d


def distributed_optimizer_line(optimizer: DistributedOptimizer, dtype: torch.dtype) -> str:
    """The start-up line: buckets, shards, and the bytes per parameter per rank."""
    buffer, d = optimizer.buffer, optimizer.buffer.d
    kind = "bf16" if dtype == torch.bfloat16 else "fp16" if dtype == torch.float16 else "fp32"
    formula = "6 + 12/d" if dtype != torch.float32 else "8 + 8/d"
    return (
        f"> distributed optimizer: {kind} parameters, fp32 gradient buffer, fp32 main parameters and "
        f"moments sharded over dp x cp = {d} ranks in {len(buffer.buckets)} bucket(s); "
        f"{formula} = {bytes_per_parameter(dtype, d):g} bytes per parameter per rank "
        f"(overlap grad reduce {buffer.overlap_grad_reduce}, overlap param gather {buffer.overlap_param_gather})"
    )
