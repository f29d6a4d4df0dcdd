"""Megatron's distributed optimizer (ZeRO-1, ``--use-distributed-optimizer``): fp32 main
parameters and Adam's moments sharded over the dp x cp ranks (experts' over their
expert-data-parallel group, ``dp x cp / ep`` ranks).

Contract: the same update as the plain optimizer on the whole model, computed by each of the
``d`` ranks holding a bucket on its shard of it (``param_and_grad_buffer.py``); Adam is
element-wise, so shards change nothing but where each element is updated::

    finish_grad_sync    shard of main_grad = mean gradient         (reduce-scatter per bucket)
    unscale (fp16)      fp32 shard / S; inf or nan on any rank: the step is skipped
    norm                ||g||^2 = sum over dp x cp shards (then tp, pp) of the counted elements
                        (an expert's elements: one shard in its edp group, its experts on one ep
                        rank; the ep x edp ranks are the dp x cp group: each element counted once)
    step                AdamW on the fp32 main shard; param shard <- main shard (cast)
    start_param_sync    whole parameters again                     (all-gather per bucket)

Bytes per parameter per rank (Megatron-LM's table, ``docs/user-guide/features/dist_optimizer.md``)::

    fp16 parameters    2 (param) + 2 (fp16 grad) + (4 main + 4 main grad + 4 + 4 moments) / d  =  4 + 16 / d
    bf16 parameters    2 (param) + 4 (fp32 grad) + (4 main + 4 + 4 moments) / d                =  6 + 12 / d
    fp32 parameters    4 (param) + 4 (fp32 grad) + (4 + 4 moments) / d                        =  8 +  8 / d

against 20, 18 and 16 without (d = 1); for the experts d is the edp group's size. With
``--grad-reduce-in-bf16`` the bf16 run's gradient buffer is bf16 too: ``4 + 16 / d``, the fp16
row. With fp32 parameters the main parameter is the parameter's own shard (a view); with bf16 or
fp16 the model's weights are half and the fp32 main copy lives here only. Padding (under d
elements per bucket) is in the buffers but has no moments.

fp16 (``--fp16``, Megatron's ``--accumulate-allreduce-grads-in-fp32`` off, its default): the
gradient buffer holds ``S g`` in fp16 (``S`` the loss scale, ``loss_scaler.py``); after the
reduce-scatter each rank copies its shard to the fp32 main gradients, divides them by ``S`` and
looks for inf / nan there; any on any rank skips the step on every rank (nothing is updated or
gathered) and the scaler backs off, as Megatron's ``MixedPrecisionOptimizer`` does.

Interleaved pipelining (v model chunks on a rank): each chunk has its own buckets
(:func:`model_chunks`; Megatron builds one ``DistributedDataParallel`` and its buffers per chunk
and one ``DistributedOptimizer`` over all of them); this optimizer steps all of them at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from distlab.gpt.distributed.grad_buckets import default_bucket_size
from distlab.gpt.distributed.param_and_grad_buffer import ParamAndGradBuffer
from distlab.gpt.optimizer.clip_grads import Gradients, clip_gradients, counted_in_norm, square_sum
from distlab.gpt.optimizer.loss_scaler import unscale_and_check
from distlab.gpt.optimizer.optimizer import group_key, make_optimizer
from distlab.gpt.optimizer.optimizer_config import OptimizerConfig
from distlab.gpt.parallel_state import ParallelState


class DistributedOptimizer:
    """``make(groups)`` (a torch optimizer over parameter groups) on the main-parameter shards.

    ``group_of(p)`` is ``p``'s parameter group (``optimizer.group_key``): its pieces join it."""

    def __init__(self, buffer: ParamAndGradBuffer, state: ParallelState, make, group_of) -> None:
        self.buffer, self.parallel = buffer, state
        self.main, self.grads = [], []  # per bucket: fp32 (S,) shards of parameters and gradients
        self.pieces = []  # [(param, bucket index, piece, at)]: the piece is shard[at : at + numel]
        groups: dict = {}
        for bucket in buffer.buckets:
            shard, grad = bucket.param_shard(), bucket.grad_shard()
            main = shard if shard.dtype == torch.float32 else shard.float()  # (S,)
            self.main.append(main)
            self.grads.append(grad if grad.dtype == torch.float32 else grad.float())  # (S,)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                lo, hi = max(offset, bucket.start), min(offset + p.numel(), bucket.end)
                if lo >= hi:
                    continue  # no element of p in this rank's shard
                piece = nn.Parameter(main[lo - bucket.start : hi - bucket.start])  # a leaf view of main
                piece.grad = self.grads[-1][lo - bucket.start : hi - bucket.start]
                self.pieces.append((p, len(self.main) - 1, piece, lo - bucket.start))
                groups.setdefault(group_of(p), []).append(piece)
        self.optimizer = make(groups)
        adam = isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW)
        self.moment_keys = ("exp_avg", "exp_avg_sq") if adam else ("momentum_buffer",)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The inner optimizer's per-piece state (empty before the first step)."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none  # the fp32 gradient buffer is kept and zeroed, as Megatron's
        self.buffer.zero_grad()

    def shard_grads(self, counted=lambda p: True) -> list[torch.Tensor]:
        """This rank's pieces of the averaged gradients (of the parameters ``counted`` keeps)."""
        return [piece.grad for p, _, piece, _ in self.pieces if counted(p)]

    @torch.no_grad()
    def finalize_gradients(
        self, tied_weight: torch.Tensor | None, *, loss_scale: float | None, clip_grad: float
    ) -> Gradients:
        """``clip_grads.finalize_gradients``'s steps on the shards: the tied embedding's two stages
        summed (whole, before its bucket's reduce-scatter), the reduce-scatters, the
        sequence-parallel sum over tp (the tp ranks' buffers have one layout), fp16's unscale, the
        norm (the shards' squares summed over dp x cp, then tp and pp) and clipping."""
        state = self.parallel
        if tied_weight is not None and state.embedding_group is not None:
            dist.all_reduce(tied_weight.main_grad, group=state.embedding_group)
        self.buffer.finish_grad_sync()
        for bucket, grad in zip(self.buffer.buckets, self.grads, strict=True):
            if grad.data_ptr() != bucket.grad_shard().data_ptr():
                grad.copy_(bucket.grad_shard())  # --grad-reduce-in-bf16: the fp32 main gradients
        if state.layout.sequence_parallel:
            sp = self.shard_grads(lambda p: getattr(p, "sequence_parallel", False))
            if sp:
                flat = torch.cat(sp)  # one message
                dist.all_reduce(flat, group=state.tp_group)
                torch._foreach_copy_(sp, list(flat.split([g.numel() for g in sp])))
        pieces = [piece for _, _, piece, _ in self.pieces]
        if loss_scale is not None and unscale_and_check(pieces, loss_scale):
            return Gradients(None, overflow=True)
        total = square_sum(self.shard_grads(lambda p: counted_in_norm(p, state.tp_rank, state.pp)))
        for group, size in ((state.dp_cp_group, state.dp * state.cp), (state.tp_group, state.tp),
                            (state.pp_group, state.pp)):  # fmt: skip
            if size > 1:
                dist.all_reduce(total, group=group)
        norm = total.sqrt()
        clip_gradients(pieces, clip_grad, norm)  # by 1 when the norm is not finite: left as they are
        return Gradients(norm)  # on the device, as clip_grads.finalize_gradients

    @torch.no_grad()
    def step(self) -> None:
        self.buffer.finish_param_sync()  # none left in flight (a bucket no forward used) to overwrite the shards
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
        for _, j, piece, at in self.pieces:
            for key in self.moment_keys:
                if j == i and self.optimizer.state.get(piece, {}).get(key) is not None:
                    out[key][at : at + piece.numel()] = self.optimizer.state[piece][key]
        return out

    @torch.no_grad()
    def load_bucket_tensors(self, i: int, tensors: dict[str, torch.Tensor], step: torch.Tensor) -> None:
        """Inverse of :meth:`bucket_tensors` (``step``: Adam's count); the parameters follow."""
        bucket = self.buffer.buckets[i]
        self.main[i].copy_(tensors["param"])
        for _, j, piece, at in self.pieces:
            if j == i:
                moments = {k: tensors[k][at : at + piece.numel()].clone() for k in self.moment_keys}
                self.optimizer.state[piece] = {"step": step.clone(), **moments}
        bucket.param_shard().copy_(self.main[i])
        if bucket.d > 1:
            self.buffer.pending.add(i)
        self.buffer.finish_param_sync()

    @torch.no_grad()
    def main_from_params(self) -> None:
        """After the model's weights were loaded: the fp32 main shards from them (bf16: a cast;
        fp32: they are the same memory). The optimizer's own state, when loaded, overrides."""
        for bucket, main in zip(self.buffer.buckets, self.main, strict=True):
            if main.data_ptr() != bucket.param_shard().data_ptr():
                main.copy_(bucket.param_shard())

    def state_dict(self) -> dict | None:
        """``--ckpt-format torch``: every bucket's tensors gathered whole (unpadded) on rank 0 of its
        group, which writes the file (None elsewhere); collective over dp x cp. ep > 1: the writers,
        edp ranks 0 (the dp x cp group's first ep ranks, a file per ep rank), gather their experts'
        buckets; dense rank 0 broadcasts them the dense ones: each file holds them, as the weights."""
        self.buffer.finish_param_sync()
        buckets = [self._gathered(i) for i in range(len(self.buffer.buckets))]
        if self.parallel.ep > 1:
            self._share_dense(buckets)
        if None in buckets:
            return None
        buckets = [{k: v if k == "numel" else v.cpu() for k, v in b.items()} for b in buckets]
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {
            "distributed_optimizer": {"buckets": buckets, "step": self.step_count(), "param_groups": groups}
        }

    def _gathered(self, i: int) -> dict | None:
        """Bucket ``i``'s tensors whole (unpadded) on rank 0 of its group, None elsewhere."""
        bucket, whole = self.buffer.buckets[i], {"numel": self.buffer.buckets[i].numel}
        for key, shard in self.bucket_tensors(i).items():
            parts = [torch.empty_like(shard) for _ in range(bucket.d)] if bucket.start == 0 else None
            if bucket.d > 1:
                dist.gather(shard.contiguous(), parts, group=bucket.group, group_dst=0)
            else:
                parts = [shard]
            whole[key] = torch.cat(parts)[: bucket.numel] if parts else None
        return whole if bucket.start == 0 else None

    def _share_dense(self, buckets: list[dict | None]) -> None:
        """ep > 1: the dense buckets' whole tensors from dp x cp rank 0 to the other writers."""
        if dist.get_rank(self.buffer.group) >= self.parallel.ep:
            return  # not in the first ep group of the dp x cp group: writes nothing
        keys = ("param", *self.moment_keys)
        for i, bucket in enumerate(self.buffer.buckets[: self.buffer.num_dense]):
            if buckets[i] is None:  # (n,) fp32 each, filled by the broadcast
                device = bucket.param_data.device
                buckets[i] = {
                    "numel": bucket.numel,
                    **{k: torch.empty(bucket.numel, device=device) for k in keys},
                }
            for key in keys:
                dist.broadcast(buckets[i][key], group=self.parallel.ep_group, group_src=0)

    def load_state_dict(self, saved: dict) -> None:
        """Inverse of :meth:`state_dict` for any dp x cp: each rank keeps its shard of the file's."""
        if "distributed_optimizer" not in saved:
            raise ValueError(
                "the checkpoint's optimizer state was written without --use-distributed-optimizer: "
                "load it without the flag (or retrain)"
            )
        saved = saved["distributed_optimizer"]
        check_layout([b["numel"] for b in saved["buckets"]], [b.numel for b in self.buffer.buckets])
        if not saved["step"]:
            return  # saved before the first step: nothing to restore
        for i, (bucket, whole) in enumerate(zip(self.buffer.buckets, saved["buckets"], strict=True)):
            device = bucket.param_data.device
            pad = bucket.param_data.numel() - bucket.numel
            shards = {k: torch.cat([whole[k].to(device), whole[k].new_zeros(pad).to(device)])[bucket.start : bucket.end]
                      for k in ("param", *self.moment_keys)}  # fmt: skip
            self.load_bucket_tensors(i, shards, saved["step"])

    def step_count(self) -> torch.Tensor:
        states = [s["step"] for s in self.optimizer.state.values() if "step" in s]
        return states[0] if states else torch.zeros(())

    def state_bytes(self) -> int:
        """This rank's optimizer-state bytes: fp32 main copies kept here (of bf16 parameters, of
        bf16 gradients) and moments."""
        own = sum(m.numel() * 4 for m, b in zip(self.main, self.buffer.buckets, strict=True)
                  if m.data_ptr() != b.param_shard().data_ptr())  # fmt: skip
        own += sum(g.numel() * 4 for g, b in zip(self.grads, self.buffer.buckets, strict=True)
                   if g.data_ptr() != b.grad_shard().data_ptr())  # fmt: skip
        moments = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                      for k, t in s.items() if k != "step")  # fmt: skip
        return own + moments


def model_chunks(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters of each of the model's v chunks (``GPTModel.chunks``, 1 without interleaving),
    in registration order: chunk ``c`` those of the blocks it runs (``per_chunk`` of ``model.layers``
    each), chunk 0 also the embeddings' (``wte``, ``wpe``: they run before it), the last chunk the
    rest (the final norm and the output layer, or E's copy: they run after it)."""
    v = getattr(model, "chunks", 1)
    if v == 1:
        return [list(model.parameters())]
    blocks = list(model.layers.values())  # (v per_chunk,): chunk c holds [c per_chunk, (c + 1) per_chunk)
    chunk_of = {p: i // model.per_chunk for i, block in enumerate(blocks) for p in block.parameters()}
    embeddings = [getattr(model, name) for name in ("wte", "wpe") if hasattr(model, name)]  # first stage
    chunk_of.update((p, 0) for module in embeddings for p in module.parameters())
    chunks = [[] for _ in range(v)]
    for p in model.parameters():
        chunks[chunk_of.get(p, v - 1)].append(p)
    return chunks


def gradient_buffer_dtype(dtype: torch.dtype, grad_reduce_in_bf16: bool) -> torch.dtype:
    """Megatron's: fp32 gradients for fp32 and bf16 parameters (bf16 with ``--grad-reduce-in-bf16``),
    fp16 ones for fp16 parameters (its ``--accumulate-allreduce-grads-in-fp32`` off by default)."""
    if dtype == torch.float16:
        return torch.float16
    return torch.bfloat16 if grad_reduce_in_bf16 else torch.float32


def build_distributed_optimizer(
    model: nn.Module,
    state: ParallelState,
    config: OptimizerConfig,
    ddp_config: DistributedDataParallelConfig,
    dtype: torch.dtype,
) -> DistributedOptimizer:
    """The buffers (parameters cast to ``dtype``; one set per model chunk) and ``config``'s optimizer
    on their shards, with ``ddp_config``'s bucket size, overlaps and gradient dtype."""
    keys = {p: group_key(name, p, config) for name, p in model.named_parameters()}
    size = ddp_config.bucket_size or default_bucket_size(state.dp * state.cp)
    buffer = ParamAndGradBuffer(
        model_chunks(model),
        state,
        bucket_size=size,
        dtype=dtype,
        grad_dtype=gradient_buffer_dtype(dtype, ddp_config.grad_reduce_in_bf16),
        overlap_grad_reduce=ddp_config.overlap_grad_reduce,
        overlap_param_gather=ddp_config.overlap_param_gather,
        hold=model.tied_embedding() if state.embedding_group is not None else None,
    )
    if ddp_config.overlap_param_gather:
        buffer.register_forward_pre_hooks(model)
    return DistributedOptimizer(buffer, state, lambda g: make_optimizer(g, config), keys.__getitem__)


def check_layout(saved: list[int], mine: list[int]) -> None:
    """A checkpoint's buckets (elements each) must be this run's: refuse with the sizes and the fix."""
    if saved != mine:
        raise ValueError(
            f"the checkpoint's distributed-optimizer buckets hold {saved} elements, this run's {mine}: "
            f"load it with the --ddp-bucket-size it was saved with (dp x cp may change)"
        )


def bytes_per_parameter(dtype: torch.dtype, d: int, grad_dtype: torch.dtype = torch.float32) -> float:
    """Megatron's table per rank: fp32 ``8 + 8 / d``; bf16 parameters with fp32 gradients
    ``6 + 12 / d``; with half gradients (fp16's, or bf16's with ``--grad-reduce-in-bf16``) ``4 + 16 / d``."""
    if dtype == torch.float32:
        return 8 + 8 / d
    return 6 + 12 / d if grad_dtype == torch.float32 else 4 + 16 / d


def distributed_optimizer_line(optimizer: DistributedOptimizer, dtype: torch.dtype) -> str:
    """The start-up line: buckets, shards, and the bytes per parameter per rank (ep > 1: the
    experts' too, over their expert-data-parallel group)."""
    buffer, d = optimizer.buffer, optimizer.buffer.d
    kind = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    grad = buffer.buckets[0].grad_data.dtype if buffer.buckets else torch.float32
    formula = "8 + 8/d" if dtype == torch.float32 else "6 + 12/d" if grad == torch.float32 else "4 + 16/d"
    chunks = f" of {buffer.chunks} model chunks" if buffer.chunks > 1 else ""
    experts = buffer.buckets[buffer.num_dense :]
    edp = experts[0].d if experts else 0
    expert_part = (
        f"; expert parameters over their expert-data-parallel group of d = {edp} rank(s) in "
        f"{len(experts)} bucket(s): {bytes_per_parameter(dtype, edp, grad):g} bytes per parameter per rank"
        if experts
        else ""
    )
    return (
        f"> distributed optimizer: {kind[dtype]} parameters, {kind[grad]} gradient buffer, fp32 main "
        f"parameters and moments sharded over dp x cp = {d} ranks in {buffer.num_dense} bucket(s){chunks}; "
        f"{formula} = {bytes_per_parameter(dtype, d, grad):g} bytes per parameter per rank{expert_part} "
        f"(overlap grad reduce {buffer.overlap_grad_reduce}, overlap param gather {buffer.overlap_param_gather})"
    )
