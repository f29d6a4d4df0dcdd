"""Runs and pictures around the engine, for tests and notebooks (Megatron-LM's ``tools/``)."""
