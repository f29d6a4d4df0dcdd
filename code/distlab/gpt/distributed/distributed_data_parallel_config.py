"""How the data-parallel gradients are reduced: megatron-core's ``DistributedDataParallelConfig``,
the fields used here (``megatron/core/distributed/distributed_data_parallel_config.py``).

Built from the command line once, by ``arguments/to_configs.py``; read by the distributed
optimizer's buffers (``optimizer/distrib_optimizer.py``) and by the run's plain data-parallel back end.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedDataParallelConfig:
    """Buckets, their overlap with backward and forward, and the dtype of the reduction."""

    overlap_grad_reduce: bool = False
    """Start each bucket's reduction during the last micro-batch's backward, as soon as its last
    gradient is accumulated."""
    overlap_param_gather: bool = False
    """Distributed optimizer: each bucket's parameter all-gather runs during the next forward."""
    bucket_size: int | None = None
    """Elements per bucket; None: megatron-core's max(40000000, 1000000 x dp)
    (``grad_buckets.default_bucket_size``)."""
    grad_reduce_in_bf16: bool = False
    """Reduce in bfloat16, half fp32's bytes (Megatron-LM's ``--grad-reduce-in-bf16``; megatron-core
    spells the other side, ``grad_reduce_in_fp32``, whose default reduces in the parameters' dtype,
    while here fp32 is the default)."""
