"""Data-parallel gradients: buckets and the finalisation after the backward, and the distributed
optimizer's buffers and shards (Megatron Core's ``distributed/`` and ``optimizer/distrib_optimizer.py``)."""
