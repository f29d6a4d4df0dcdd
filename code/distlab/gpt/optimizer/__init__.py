"""Optimizer, distributed optimizer, gradient norm and clipping, learning-rate schedule, precision and
loss scaling (Megatron Core's ``optimizer/`` and ``optimizer_param_scheduler.py``)."""
