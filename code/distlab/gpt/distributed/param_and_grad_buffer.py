"""Contiguous parameter and fp32 gradient buffers in buckets, for the distributed optimizer
(Megatron Core's ``_ParamAndGradBuffer``, ``--use-distributed-optimizer``).

Contract. The parameters, cut into the buckets of ``grad_buckets.assign_buckets`` (reverse
registration order, ``--ddp-bucket-size`` elements), are copied into one flat buffer per bucket
and become views of it (``p.data``), in the model's dtype; each gets ``p.main_grad``, a view of a
flat gradient buffer of the same layout, fp32 (bf16 with ``--grad-reduce-in-bf16``). Each bucket
is padded to a multiple of ``d``, the size of the group of ranks holding the same parameters, and
cut into ``d`` equal shards; rank ``r`` of that group owns ``[r S, (r + 1) S)``, ``S = padded / d``::

    bucket   | p3 ........ | p2 .... | p1 ...... | pad |     padded = ceil(n / d) d
    shards   | rank 0   | rank 1   | rank 2   | rank 3   |     S elements each

    backward        p.main_grad += p.grad (a hook), p.grad = None
    reduce_scatter  shard_r(main_grad) = sum_group (main_grad / (dp cp))   (one per bucket)
    (optimizer)     updates the fp32 main parameters of shard_r only
    all_gather      param_buffer = concat_r shard_r(param_buffer)      (one per bucket)

Two kinds of buckets, as megatron-core's ``DistributedDataParallel`` has two lists of buffers: the
dense parameters' over ``dp_cp_group`` (``d = dp x cp``), and with ep > 1 the experts'
(``grad_buckets.is_expert``) over ``edp_group``, the ``d = dp x cp / ep`` ranks holding the same
experts. Both kinds scale by ``1 / (dp x cp)`` before the sum (Megatron's
``gradient_scaling_factor`` and ``expert_gradient_scaling_factor`` without
``average_in_collective``): an expert's gradient on a rank already sums the tokens its ep group's
ranks sent it, so the sum over the edp group covers every dp x cp rank's tokens once. With
interleaved pipelining (v model chunks per rank) each chunk has its own buckets of each kind, as
Megatron wraps each chunk in its own ``DistributedDataParallel``: no bucket mixes two chunks, so a
chunk's buckets start their reduce-scatters in that chunk's last backward.

Bytes per parameter on a rank (parameters in ``k`` bytes): ``k`` for the parameter and 4 for its
fp32 gradient here (2 in bf16); ``optimizer/distrib_optimizer.py`` adds the 12 / d (bf16: fp32 main copy + two moments)
or 8 / d (fp32: the moments; the parameter is its own main copy).

``overlap_grad_reduce``: the last gradient of a bucket accumulated during the step's last
micro-batch (the schedule's ``grad_sync``; with pp > 1 each stage's, and chunk's, last backward)
starts its reduce-scatter at once (held back: the bucket of the tied embedding, whose
two stages' gradients are summed first). ``overlap_param_gather``: after the step only the bucket
the forward needs first (the last one of each kind and chunk) starts its all-gather; a module's
forward pre-hook waits for the bucket of its parameters and starts the next one of its kind and
chunk (Megatron's chain, one per list). Without them the same collectives run one after the
other, with the same sums: the flags move when, never what.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.distributed.grad_buckets import assign_buckets, is_expert
from distlab.gpt.parallel_state import ParallelState


class Bucket:
    """One bucket's buffers, this rank's shard of them, and its collectives in flight over
    ``group`` (``d`` ranks, this one ``rank``), the gradients scaled by ``scale`` first."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup | None,
        d: int,
        rank: int,
        scale: float,
        dtypes: tuple[torch.dtype, torch.dtype],  # the parameters', the gradients'
    ) -> None:
        dtype, grad_dtype = dtypes
        self.group, self.d, self.scale = group, d, scale
        self.params, self.numel = params, sum(p.numel() for p in params)
        self.shard_size = -(-self.numel // d)  # S = ceil(n / d)
        device = params[0].device
        self.param_data = torch.zeros(self.shard_size * d, dtype=dtype, device=device)  # (S d,)
        self.grad_data = torch.zeros(self.shard_size * d, dtype=grad_dtype, device=device)  # (S d,)
        self.offsets, offset = [], 0
        for p in params:
            self.offsets.append(offset)
            self.param_data[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.param_data[offset : offset + p.numel()].view(p.shape)
            p.main_grad = self.grad_data[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        self.start, self.end = rank * self.shard_size, (rank + 1) * self.shard_size  # this rank's
        self.ready, self.started, self.grad_work, self.param_work = 0, False, None, None

    def grad_shard(self) -> torch.Tensor:
        return self.grad_data[self.start : self.end]  # (S,)

    def param_shard(self) -> torch.Tensor:
        return self.param_data[self.start : self.end]  # (S,)


class ParamAndGradBuffer:
    """The parameters of each model chunk (``chunks``: one list, registration order, per chunk; one
    chunk without interleaving) in bucketed buffers: the dense ones sharded over dp x cp, with
    ep > 1 the experts' over their expert-data-parallel group (after every chunk's dense buckets)."""

    def __init__(
        self,
        chunks: Sequence[Sequence[nn.Parameter]],
        state: ParallelState,
        *,
        bucket_size: int,
        dtype: torch.dtype,
        grad_dtype: torch.dtype = torch.float32,  # --grad-reduce-in-bf16: bf16
        overlap_grad_reduce: bool = False,
        overlap_param_gather: bool = False,
        hold: torch.Tensor | None = None,  # its bucket waits for finish (the tied embedding)
    ) -> None:
        self.group, self.d = state.dp_cp_group, state.dp * state.cp  # the dense parameters'
        self.chunks = len(chunks)  # v model chunks (interleaved pipelining), each its own buckets
        self.overlap_grad_reduce, self.overlap_param_gather = overlap_grad_reduce, overlap_param_gather
        trained = [[p for p in chunk if p.requires_grad] for chunk in chunks]
        expert = [[p for p in chunk if state.ep > 1 and is_expert(p)] for chunk in trained]
        dense = [[p for p in chunk if not (state.ep > 1 and is_expert(p))] for chunk in trained]
        kinds = [(chunk, self.group, self.d) for chunk in dense] + [
            (chunk, state.edp_group, self.d // state.ep) for chunk in expert if chunk
        ]  # every chunk's dense parameters, then every chunk's experts
        self.buckets: list[Bucket] = []
        # the bucket of the same kind and chunk that the forward needs next
        self.next_gather: list[int | None] = []
        for n, (kind, group, d) in enumerate(kinds):
            rank, first = dist.get_rank(group) if d > 1 else 0, len(self.buckets)
            for b in assign_buckets(kind, bucket_size):
                self.buckets.append(Bucket(b, group, d, rank, 1 / self.d, (dtype, grad_dtype)))
                self.next_gather.append(len(self.buckets) - 2 if len(self.buckets) - 1 > first else None)
            if n == len(dense) - 1:
                self.num_dense = len(self.buckets)  # buckets [0, num_dense) are the dense ones
        self.bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b.params}
        self.held = {self.bucket_of[hold]} if hold is not None and hold in self.bucket_of else set()
        self.pending: set[int] = set()  # buckets whose all-gather has not been waited for
        self.last_micro_batch = False  # armed by the schedule for its chunk's last backward of a step
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, p: nn.Parameter) -> None:
        """Hook: ``p.main_grad += p.grad``, drop ``p.grad``; a full bucket may start."""
        p.main_grad.add_(p.grad)
        p.grad = None
        i = self.bucket_of[p]
        if not (self.overlap_grad_reduce and self.last_micro_batch) or i in self.held:
            return
        bucket = self.buckets[i]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._reduce_scatter(bucket, async_op=True)

    @staticmethod
    def _reduce_scatter(bucket: Bucket, async_op: bool) -> None:
        """Scale the bucket by ``1 / (dp cp)``, then sum it over its group into this rank's shard."""
        bucket.started = True
        if bucket.scale != 1:
            bucket.grad_data.mul_(bucket.scale)
        if bucket.d > 1:  # in place: the output is this rank's shard of the input, as Megatron's
            bucket.grad_work = dist.reduce_scatter_single(
                bucket.grad_shard(), bucket.grad_data, group=bucket.group, async_op=async_op
            )

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.grad_data.zero_()

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Start the buckets not yet started, wait for all; this rank's shards hold the mean."""
        for bucket in self.buckets:
            if not bucket.started:
                self._reduce_scatter(bucket, async_op=False)
        for bucket in self.buckets:
            if bucket.grad_work is not None:
                bucket.grad_work.wait()
            bucket.grad_work, bucket.ready, bucket.started = None, 0, False
        self.last_micro_batch = False

    @torch.no_grad()
    def start_param_sync(self) -> None:
        """All-gather the updated shards: every bucket now, or (overlap) the forward's first of
        each kind (the last bucket of each: the others follow in :meth:`wait_param_sync`)."""
        self.pending = {i for i, bucket in enumerate(self.buckets) if bucket.d > 1}
        if self.overlap_param_gather:
            for i in sorted(self.pending - {j for j in self.next_gather if j is not None}):
                self._all_gather(i)
        else:
            self.finish_param_sync()

    def _all_gather(self, i: int) -> None:
        bucket = self.buckets[i]
        if i in self.pending and bucket.param_work is None:
            bucket.param_work = dist.all_gather_single(
                bucket.param_data, bucket.param_shard(), group=bucket.group, async_op=True
            )

    def wait_param_sync(self, i: int) -> None:
        """Bucket ``i``'s parameters are whole on return; the next bucket's all-gather starts."""
        if i not in self.pending:
            return
        self._all_gather(i)
        if self.next_gather[i] is not None:  # Megatron's chain: the next bucket in forward order
            self._all_gather(self.next_gather[i])
        self.buckets[i].param_work.wait()
        self.buckets[i].param_work = None
        self.pending.discard(i)

    def finish_param_sync(self) -> None:
        """Every pending all-gather started and waited for (before a save, an evaluation's end)."""
        for i in reversed(range(len(self.buckets))):
            self.wait_param_sync(i)

    def register_forward_pre_hooks(self, model: nn.Module) -> None:
        """``--overlap-param-gather``: each module waits for its own parameters' buckets, and for
        those of the children whose parameters its forward reads itself, never calling theirs (named
        by ``reads_parameters_of``: an expert's fc1 and fc2, the GPT's untied output layer)."""
        for module in model.modules():
            read = [getattr(module, name, None) for name in getattr(module, "reads_parameters_of", ())]
            params = [
                *module.parameters(recurse=False),
                *(p for m in read if m is not None for p in m.parameters()),
            ]
            owned = sorted({self.bucket_of[p] for p in params if p in self.bucket_of})
            if owned:
                module.register_forward_pre_hook(lambda _m, _a, owned=owned: self._wait_all(owned))

    def _wait_all(self, buckets: list[int]) -> None:
        for i in reversed(buckets):
            self.wait_param_sync(i)
