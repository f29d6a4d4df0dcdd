"""Optimizer, learning-rate schedule, precision and loss scaling (Megatron Core's ``optimizer/`` and
``optimizer_param_scheduler.py``)."""
