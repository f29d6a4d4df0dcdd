"""Mixture of experts: router, experts and expert parallelism (Megatron Core's ``transformer/moe/``)."""
