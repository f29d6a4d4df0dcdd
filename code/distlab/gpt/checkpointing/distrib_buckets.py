"""The distributed optimizer's state in a ``--ckpt-format torch_dist`` checkpoint (Megatron's
``dp_reshardable`` format), keyed so that no two ranks write one key with different data.

Bucket ``i``'s fp32 main parameters and moments (``<name>``: ``param``, ``exp_avg``,
``exp_avg_sq``) on pipeline stage ``k`` are one tensor each, of shape (tp, bucket length): row
``t`` tensor-parallel rank t's bucket, of which rank ``r`` of the bucket's group holds
``[r S, (r + 1) S)`` cut at the length (``tp_chunks.bucket_chunk``)::

    optimizer.distrib.pp<k>.bucket<i>.<name>        a dense bucket: the same parameters on every
                                                    ep rank, sharded over dp x cp
    optimizer.distrib.pp<k>.ep<e>.bucket<i>.<name>  an expert bucket (ep > 1): ep rank e's experts
                                                    [e E / ep, (e + 1) E / ep), sharded over their
                                                    expert-data-parallel group (dp x cp / ep ranks)
    optimizer.distrib.step                          Adam's step count

Without ``ep<e>`` every ep rank would write its own experts' shards under one key at the same
offsets, and DCP, taking them for copies, would keep one rank's: a load would give every ep rank
the experts' state of one (Megatron keys its expert optimizer by the expert-model-parallel rank,
its ``data_parallel_group_idx``, for the same reason). DCP reads the chunks back for another
dp x cp; tp, ep and the buckets (``--ddp-bucket-size``) must be the saved ones (:func:`check`),
or ``--no-load-optim`` loads the weights alone, which reshard.
"""

from __future__ import annotations

import re

import torch

from distlab.gpt.checkpointing import tp_chunks
from distlab.gpt.optimizer.distrib_optimizer import DistributedOptimizer, check_layout

#: A bucket's main parameters in DCP's metadata: stage, ep rank (expert buckets), bucket index.
PARAM_KEY = re.compile(r"optimizer\.distrib\.pp(\d+)\.(?:ep(\d+)\.)?bucket(\d+)\.param")


def bucket_key(optimizer: DistributedOptimizer, i: int) -> str:
    """Bucket ``i``'s key on this rank, less ``optimizer.distrib.`` and the tensor's name."""
    parallel = optimizer.parallel
    expert = parallel.ep > 1 and i >= optimizer.buffer.num_dense
    return f"pp{parallel.pp_rank}." + (f"ep{parallel.ep_rank}." if expert else "") + f"bucket{i}"


def state(optimizer: DistributedOptimizer) -> dict:
    """What DCP saves of the optimizer, or loads into: this rank's chunk of every bucket's tensors
    (``<bucket_key>.<name>``) and the step count."""
    buffer, parallel = optimizer.buffer, optimizer.parallel
    out = {"step": optimizer.step_count().clone()}
    for i, bucket in enumerate(buffer.buckets):
        real = max(0, min(bucket.end, bucket.numel) - bucket.start)  # this rank's unpadded elements
        for name, shard in optimizer.bucket_tensors(i).items():
            out[f"{bucket_key(optimizer, i)}.{name}"] = tp_chunks.bucket_chunk(
                shard[:real], bucket.start, bucket.numel, parallel.tp, parallel.tp_rank
            )
    return out


def check(optimizer: DistributedOptimizer, saved: dict, then: dict, folder: str) -> None:
    """Before ``dcp.load`` reads any: the buckets in ``saved`` (DCP's metadata by key), written
    with the arguments ``then``, must be of this run's tp, ep and bucket sizes."""
    parallel = optimizer.parallel
    for flag, was, now in (
        ("--tensor-model-parallel-size", then["tensor_model_parallel_size"], parallel.tp),
        ("--expert-model-parallel-size", then["expert_model_parallel_size"], parallel.ep),
    ):
        if was != now:
            raise ValueError(
                f"{folder}'s distributed-optimizer state was written with {flag} {was} and this run "
                f"has {now}: each rank's buckets hold the shards of its own tp rank's parameters and ep "
                f"rank's experts (Megatron's dp_reshardable format reshards over dp x cp only); load it "
                f"with {flag} {was}, or with --no-load-optim (the weights reshard)"
            )
    sizes = {}  # bucket index -> length, of this rank's stage and ep rank
    for key, meta in saved.items():
        found = PARAM_KEY.fullmatch(key)
        if found and int(found[1]) == parallel.pp_rank and found[2] in (None, str(parallel.ep_rank)):
            sizes[int(found[3])] = meta.size[1]
    check_layout([sizes[i] for i in sorted(sizes)], [b.numel for b in optimizer.buffer.buckets])


def load(optimizer: DistributedOptimizer, loaded: dict) -> None:
    """Put the loaded chunks in place (``loaded``: :func:`state`'s, filled by ``dcp.load``)."""
    if not loaded["step"]:
        return  # saved before the first step
    for i, bucket in enumerate(optimizer.buffer.buckets):
        shards = {}
        for name in ("param", *optimizer.moment_keys):
            local = loaded[f"{bucket_key(optimizer, i)}.{name}"].flatten()  # (real,)
            shards[name] = torch.zeros_like(bucket.param_shard(), dtype=torch.float32)
            shards[name][: local.numel()] = local
        optimizer.load_bucket_tensors(i, shards, loaded["step"])
