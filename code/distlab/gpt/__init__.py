"""Megatron-style GPT pretraining: model, data, parallelism and training loop."""
