"""Data-parallel gradient reduction in buckets, overlapped with backward (``--overlap-grad-reduce``).

The average over the ranks holding the same weights, ``g = (1 / (dp cp)) sum_r g_r`` over
``state.dp_cp_group`` (the dp group when cp = 1), is element-wise, so it may be computed piece by piece.
The parameters, in the reverse of their registration order (roughly the order backward produces
their gradients: last layer first), are cut into buckets of at least ``--ddp-bucket-size``
elements (Megatron's meaning; default ``max(4e7, 1e6 x dp x cp)``: Megatron-LM's ``get_model``
sizes them by the dp x cp group, ``resolve_ddp_bucket_size`` in ``megatron/training/training.py``,
before megatron-core's ``DistributedDataParallel`` would fall back to its dp group alone)::

    params   wte wpe | layer0 ... layer(L-1) | ln_f            (registration order)
    buckets  [ln_f, layer(L-1) ...] [... layer0 ...] [... wpe, wte]   (bucket 0 reduced first)

Each bucket is one flat all-reduce ``(n_bucket,)`` over that group. Experts' parameters (ep > 1)
are not in the buckets: ``gradients.reduce_gradients`` reduces them over their own group. With ``overlap`` each
parameter's post-accumulate-grad hook counts it ready, and the bucket's all-reduce starts
asynchronously as soon as its last gradient is accumulated, while backward goes on with the
earlier layers; only in the backward of the step's last micro-batch of each model chunk (the
earlier ones only accumulate, as under Megatron's ``no_sync``: every schedule, pipelined and
interleaved ones included, sets :attr:`GradBuckets.last_micro_batch` before each backward through
the back end's ``set_grad_sync``; a bucket spanning two chunks starts when the later one's last
backward completes it). With pp > 1 the bucket of the tied embedding is held back: its two
stages' gradients are summed before the dp average. :meth:`GradBuckets.finish`, before the norm and the
optimizer, waits for every handle. Without ``overlap`` ``finish`` starts the same buckets one
after the other, after backward: the flag changes when each sum starts, never what it adds, so
the two runs are equal bit for bit. (Megatron uses one bucket without overlap; the same buckets
here keep that equality exact.) The exposed communication is the time ``finish`` takes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.parallel_state import ParallelState


def is_expert(p: nn.Parameter) -> bool:
    """An expert's parameter (``transformer/moe/moe_layer.py`` marks them): with ep > 1 reduced over its own group,
    not in the dense buckets (``gradients.reduce_gradients``; the distributed optimizer's expert buckets)."""
    return getattr(p, "expert_parallel", False)


def default_bucket_size(dp_cp: int) -> int:
    """Megatron-LM's default ``--ddp-bucket-size`` (elements), ``max(4e7, 1e6 x dp x cp)``: large
    enough not to be latency-bound. ``dp_cp`` is the size of the group the buckets are reduced over,
    as ``resolve_ddp_bucket_size`` in Megatron-LM's ``training.py`` reads it (``pg_collection.dp_cp``)."""
    return max(40_000_000, 1_000_000 * dp_cp)


def assign_buckets(params: Sequence[nn.Parameter], bucket_size: int) -> list[list[nn.Parameter]]:
    """``params`` in registration order -> buckets in the order backward fills them: the reversed
    list, closed as soon as a bucket holds ``>= bucket_size`` elements."""
    if bucket_size <= 0:
        raise ValueError(f"--ddp-bucket-size {bucket_size} must be a positive number of elements")
    buckets, current, numel = [], [], 0
    for p in reversed(params):
        current.append(p)
        numel += p.numel()
        if numel >= bucket_size:
            buckets.append(current)
            current, numel = [], 0
    if current:
        buckets.append(current)
    return buckets


class _Bucket:
    """One flat all-reduce of some parameters' gradients, started once per step."""

    def __init__(self, params: list[nn.Parameter], reduce_dtype: torch.dtype | None = None) -> None:
        self.params, self.ready, self.reduce_dtype = params, 0, reduce_dtype
        self.flat: torch.Tensor | None = None  # (n_bucket,) the sum, while in flight
        self.work: dist.Work | None = None

    def start(self, group: dist.ProcessGroup | None, async_op: bool) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            self.flat = torch.cat([g.reshape(-1) for g in grads])  # (n_bucket,)
            if self.reduce_dtype is not None:  # --grad-reduce-in-bf16: the sum travels in bf16
                self.flat = self.flat.to(self.reduce_dtype)
            self.work = dist.all_reduce(self.flat, group=group, async_op=async_op)

    def finish(self, replicas: int) -> None:
        """Wait, then ``g = sum / replicas`` back into every ``.grad``; ready for the next step."""
        if self.work is not None:
            self.work.wait()
        if self.flat is not None:
            self.flat /= replicas
            offset = 0
            for g in (p.grad for p in self.params if p.grad is not None):
                g.copy_(self.flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.flat, self.work, self.ready = None, None, 0


class GradBuckets:
    """The dp (x cp) reduction of the dense ``params`` (registration order) in buckets, overlapped or not."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        state: ParallelState,
        *,
        bucket_size: int,
        overlap: bool,
        reduce_dtype: torch.dtype | None = None,  # --grad-reduce-in-bf16: torch.bfloat16
        hold: torch.Tensor | None = None,  # its bucket waits for finish (the tied embedding)
    ) -> None:
        self.state, self.overlap = state, overlap
        self.group, self.replicas = state.dp_cp_group, state.dp * state.cp  # the same weights
        dense = [p for p in params if p.requires_grad and not (state.ep > 1 and is_expert(p))]
        self.buckets = [_Bucket(b, reduce_dtype) for b in assign_buckets(dense, bucket_size)]
        self.started = [False] * len(self.buckets)
        self.last_micro_batch = False  # armed by the schedule for its chunk's last backward of a step
        self.enabled = self.replicas > 1
        if overlap and self.enabled:
            for i, bucket in enumerate(self.buckets):
                if any(p is hold for p in bucket.params):
                    continue  # summed over the embedding group first (gradients.reduce_gradients)
                for p in bucket.params:
                    p.register_post_accumulate_grad_hook(lambda _p, i=i: self._grad_ready(i))

    def _grad_ready(self, i: int) -> None:
        """Hook: one more final gradient in bucket ``i``; all of them -> start its all-reduce."""
        if not self.last_micro_batch:
            return
        bucket = self.buckets[i]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.start(self.group, async_op=True)
            self.started[i] = True

    @torch.no_grad()
    def finish(self) -> None:
        """Start what has not started (all buckets without overlap), wait for all, average."""
        if self.enabled:
            for i, bucket in enumerate(self.buckets):
                if not self.started[i]:
                    bucket.start(self.group, async_op=True)
            for bucket in self.buckets:
                bucket.finish(self.replicas)
        self.started = [False] * len(self.buckets)
        self.last_micro_batch = False
