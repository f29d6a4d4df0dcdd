"""Reading what runs leave behind: Megatron log lines, NCCL's transport lines, TensorBoard
scalars and profiler traces, each turned into rows that a notebook tabulates or plots."""
