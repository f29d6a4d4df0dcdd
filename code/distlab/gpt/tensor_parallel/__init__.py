"""Tensor parallelism: the f and g operators and the layers split over tp ranks (Megatron Core's ``tensor_parallel/``)."""
