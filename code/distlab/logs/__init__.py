"""Reading what runs leave behind: Megatron log lines, NCCL's transport lines, TensorBoard
scalars and profiler traces, each turned into rows that a notebook tabulates or plots.

The engine's lines are :class:`~distlab.log_line.LogLine` objects defined beside the code that
prints them; the readers here import them from the engine (``distlab.logs`` -> ``distlab.gpt``,
never back)::

    BANNER                           gpt/parallel_state.py
    BATCH, PARAMETERS                gpt/build.py
    VOCAB_PADDING                    gpt/tensor_parallel/layers.py
    CONTEXT_PARALLEL                 gpt/context_parallel/ring_attention.py
    DEEPSPEED                        gpt/deepspeed/config.py
    MEMORY, RANK_COORDS, PREDICTION  gpt/memory/meters.py
    ITERATION, VALIDATION            gpt/training/log.py
    STRAGGLER, STRAGGLER_RANKS       gpt/training/straggler.py
    SAVED                            gpt/checkpointing/checkpointer.py
    COMPILE                          gpt/native/torch_compile.py
    DRY_RUN, DRY_RUN_*               gpt/planning/dry_run.py
    EXIT_SIGNAL, HANG, HANG_DUMPS    gpt/pretrain.py
    MOE                              gpt/pretrain.py (read by experts.tokens_per_expert)
"""
