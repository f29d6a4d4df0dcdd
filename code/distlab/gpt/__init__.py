"""Megatron-style GPT pretraining: model, data, data / tensor / pipeline parallelism, training loop.

Notation, the same in every module's docstrings and shape comments::

    b    micro-batch size: samples in one forward/backward on one rank (--micro-batch-size)
    m    micro-batches per rank and step (gradient-accumulation steps; the pipeline's m)
    B    global batch: samples per optimizer step, B = b x dp x m (--global-batch-size)
    T    sequence length (--seq-length)             H    hidden size (--hidden-size)
    F    MLP width, 4H by default                   n    attention heads, of size H / n
    V    vocabulary, padded to a multiple of --make-vocab-size-divisible-by x tp    L  layers
    tp, pp, dp     tensor-, pipeline-, data-parallel sizes; world size = tp x pp x dp
    p, r           size of a process group and this rank's index in it
    F_i, B_i       in pipeline schedules: forward and backward of micro-batch i

A tensor entering the model is (b, T), a hidden state (b, T, H), a logit slice (b, T, V / tp).

Reading order, one idea per file:

    layout              the run's tp x dp x pp layout (Megatron's rank order) and batch arithmetic,
                        validated once; where a new dimension is added
    parallel_state      this rank's coordinates in the layout and its process groups
    tp_communications   the f and g operators: identity one way, all-reduce the other
    tensor_parallel     column / row-parallel linear, vocabulary-parallel embedding and loss
    recompute           attention backends and recomputation flags: what a block keeps
    model               the GPT block by block: where f and g sit; one stage of the pipeline
    pp_communications   named sends and receives between stages, each one batched p2p call
    pipeline_parallel   GPipe and 1F1B: the order of forwards and backwards, the bubble
    gradients           after the backward: tied embedding, dp all-reduce, norm, clipping
    interfaces          what a step shares: micro-batches, the backward hook, the back end
    training            micro-batches of a global batch, the one step loop, evaluation
    build               everything a run holds, built once from the arguments and the layout
    pretrain            the training loop of pretrain_gpt.py

Beside them: arguments (Megatron's command line), tokenizer, indexed_dataset and gpt_dataset
(data), optimizer (AdamW, LR schedule), precision (fp32/fp16/bf16, decided once) and loss_scaler
(fp16), checkpointing (Megatron's legacy layout) and dist_checkpointing (--ckpt-format
torch_dist: DCP, sharded, --async-save), log and flops (Megatron's log line, TensorBoard, the
profiler; MFU; every printed line defined in ``distlab.logs.formats``), memory (measured) and
memory_estimate (predicted), deepspeed_config (DeepSpeed's JSON, checked) and deepspeed_engine
(its back end), fsdp2 (PyTorch's fully_shard as a back end: --use-torch-fsdp2),
pipeline_timeline and pipeline_plot (recorded F/B spans and their Gantt chart), local_run
(spawned runs for tests and notebooks).
"""
