"""The training step, evaluation, the log line, FLOPs and fault handling (Megatron's ``training/``)."""
