"""Checkpoints: Megatron's legacy format, DCP (``torch_dist``), and the run's checkpointer (Megatron's
``training/checkpointing.py`` and Megatron Core's ``dist_checkpointing/``)."""
