"""Memory: the estimate before a run, the meters during it, the measurements that check them (Megatron's
``training/theoretical_memory_usage.py``)."""
