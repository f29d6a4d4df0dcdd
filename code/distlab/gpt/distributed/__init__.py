"""Data-parallel gradients: buckets and the finalisation after the backward (Megatron Core's
``distributed/``)."""
