"""Data-parallel gradients: buckets and their reduction after the backward, and the distributed
optimizer's buffers (Megatron Core's ``distributed/``)."""
