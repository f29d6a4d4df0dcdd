"""Megatron-style GPT pretraining: model, data, data / tensor / pipeline parallelism, training loop.

Notation, the same in every module's docstrings and shape comments::

    b    micro-batch size: samples in one forward/backward on one rank (--micro-batch-size)
    m    micro-batches per rank and step (gradient-accumulation steps; the pipeline's m)
    B    global batch: samples per optimizer step, B = b x dp x m (--global-batch-size)
    T    sequence length (--seq-length)             H    hidden size (--hidden-size)
    F    MLP width, 4H by default                   n    attention heads, of size H / n
    V    vocabulary, padded to a multiple of --make-vocab-size-divisible-by x tp    L  layers
    tp, pp, dp, cp tensor-, pipeline-, data-, context-parallel sizes: world = dp x tp x pp x cp
    ep             expert-parallel size, folded into dp x cp (it splits those ranks; no factor of its own);
                   each expert's MLP is split over tp (etp = tp)
    v              model chunks per pipeline rank (virtual stages, interleaved 1F1B)
    p, r           size of a process group and this rank's index in it
    F_i, B_i       in pipeline schedules: forward and backward of micro-batch i

A tensor entering the model is (b, T), a hidden state (b, T, H), a logit slice (b, T, V / tp).

Megatron Core name -> here: each piece of ``megatron/core/`` (left) and where this package keeps
it (right, under ``distlab/gpt/``)::

    parallel_state.py                               -> parallel_state.py
    tensor_parallel/mappings.py                     -> tensor_parallel/mappings.py
    tensor_parallel/layers.py                       -> tensor_parallel/layers.py
    tensor_parallel/cross_entropy.py                -> tensor_parallel/cross_entropy.py
    tensor_parallel/random.py                       -> tensor_parallel/rng_tracker.py
    transformer/transformer_config.py               -> transformer/config.py
    transformer/attention.py                        -> transformer/attention.py
    transformer/mlp.py                              -> transformer/mlp.py
    transformer/transformer_layer.py                -> transformer/transformer_layer.py
    transformer/transformer_block.py                -> transformer/gpt_model.py (its blocks)
    transformer/moe/                                -> transformer/moe/
    models/gpt/gpt_model.py                         -> transformer/gpt_model.py
    pipeline_parallel/p2p_communication.py          -> pipeline_parallel/p2p_communication.py
    pipeline_parallel/schedules.py                  -> pipeline_parallel/schedules.py, interleaved.py
    distributed/distributed_data_parallel_config.py -> distributed/distributed_data_parallel_config.py
    distributed/param_and_grad_buffer.py            -> distributed/param_and_grad_buffer.py, grad_buckets.py
    distributed/finalize_model_grads.py             -> distributed/gradients.py
    optimizer/optimizer_config.py                   -> optimizer/optimizer_config.py
    optimizer/optimizer.py                          -> optimizer/optimizer.py
    optimizer/grad_scaler.py                        -> optimizer/loss_scaler.py
    optimizer/clip_grads.py                         -> optimizer/clip_grads.py
    optimizer/distrib_optimizer.py                  -> optimizer/distrib_optimizer.py
    optimizer_param_scheduler.py                    -> optimizer/optimizer_param_scheduler.py
    datasets/indexed_dataset.py                     -> data/indexed_dataset.py
    datasets/gpt_dataset.py                         -> data/gpt_dataset.py
    dist_checkpointing/                             -> checkpointing/dist_checkpointing.py

The map, in reading order: one concern per subpackage; after ``~`` what it mirrors in Megatron
Core (``megatron/core/``; ``training/`` is ``megatron/training/``). Imports run down this list,
never up (``tests/test_imports.py`` checks it)::

    layout.py          the dp x tp x pp x cp layout: rank order, batch arithmetic
                       ~ parallel_state.py's RankGenerator, num_microbatches_calculator.py
                         (torchtitan's ParallelDims)
    model_layout.py    every rule of a model against a layout (heads, FFN, vocabulary, query
                       groups over tp; the sequence over 2 cp and cp x tp; experts over ep;
                       layers over pp x vp), named and checked by one function
                       ~ the checks of TransformerConfig.__post_init__ and validate_args
    interfaces.py      what a step shares: micro-batches, the backward hook, the back end
    parallel_state.py  this rank's coordinates in the layout and its process groups
                       ~ parallel_state.py
    data/              tokenizer (GPT-2 BPE), tokenizers (Null, sentencepiece, HuggingFace),
                       indexed_dataset, mock_dataset, gpt_dataset ~ tokenizers/, datasets/
    tensor_parallel/   mappings (the f and g operators), layers (column / row-parallel linear,
                       vocabulary-parallel embedding), cross_entropy (the loss over vocabulary
                       slices), rng_tracker (two random streams)
                       ~ tensor_parallel/ mappings, layers, cross_entropy, random
    context_parallel/  ring_attention: the sequence over cp ranks
                       ~ Transformer Engine's context-parallel attention (cp_comm_type p2p)
    transformer/       recompute (attention backends, what a block keeps), config (GPT-2 or Llama's
                       switches), norms, rope, attention (grouped-query), mlp (GeLU, SwiGLU),
                       transformer_layer (one pre-norm block), gpt_model (the GPT block by block; one
                       pipeline stage) ~ transformer/, models/gpt/gpt_model.py;
                       moe/: router (top-k, aux loss), experts (their MLPs, split over tp),
                       token_dispatcher (allgather, alltoall), expert_parallel (the all-to-alls),
                       moe_layer ~ transformer/moe/ router, moe_utils, experts, token_dispatcher, moe_layer
    pipeline_parallel/ p2p_communication, schedules (GPipe, 1F1B), interleaved (1F1B over v chunks),
                       timeline and plot (recorded F/B spans) ~ pipeline_parallel/
    deepspeed/         config (DeepSpeed's JSON, checked), engine (ZeRO as a back end)
                       ~ Megatron-DeepSpeed
    distributed/       distributed_data_parallel_config, grad_buckets (dp reduction overlapped with
                       backward), gradients (tied embedding, dp all-reduce, the sequence-parallel sum),
                       param_and_grad_buffer (the distributed optimizer's buffers, reduce-scatter and
                       all-gather) ~ distributed/ param_and_grad_buffer, finalize_model_grads
    optimizer/         optimizer_config, optimizer (AdamW), optimizer_param_scheduler (the LR schedule),
                       loss_scaler (fp16), precision, clip_grads (norm, clipping, the whole gradient
                       finalisation), distrib_optimizer (--use-distributed-optimizer: ZeRO-1 over dp x cp)
                       ~ optimizer/ optimizer, clip_grads, distrib_optimizer; optimizer_param_scheduler.py
    checkpointing/     checkpoint_config, checkpointing (Megatron's legacy format), dist_checkpointing
                       (DCP: torch_dist, the default), distrib_buckets (the distributed optimizer's
                       state in DCP), checkpointer (the run's saves and load, --async-save)
                       ~ training/checkpointing.py, dist_checkpointing/
    training/          training (micro-batches, the step, evaluation), log (the log line, TensorBoard,
                       the profiler), flops (MFU), fault_handling (signals, hangs), housekeeping
                       (--manual-gc, --empty-unused-memory-level)
                       ~ training/training.py, training/dist_signal_handler.py
    arguments/         groups (the flags, one dataclass per Megatron group), parser, validation
                       (validate_args -> the Layout), architecture, backends, to_configs (the flags
                       mapped once to the typed configs of transformer/ to training/, which never
                       import this package), from_args (planning/'s calls with the arguments)
                       ~ training/arguments.py
    native/            PyTorch's own: dtensor_parallel, fsdp2, torch_pipelining, torch_compile,
                       plan_check ~ distributed/torch_fully_sharded_data_parallel.py (torchtitan)
    memory/            setup and memory_estimate (predicted), meters (measured), activation_memory
                       and cp_measure (one against the other) ~ training/theoretical_memory_usage.py
    build.py           everything a run holds, built once from the arguments and the layout
                       ~ training/training.py's setup_model_and_optimizer
    planning/          dry_run (one rank at full size on the meta device, fake process group),
                       collectives (what a step issues, per group), hardware, step_model, planner
                       ~ torchtitan's dry runs; the Ultra-Scale Playbook's step-time estimates
    pretrain.py        the training loop of pretrain_gpt.py ~ training/training.py's pretrain
    inference/         kv_cache, generation (greedy, top-k, top-p), course_checkpoint (any layout
                       read whole; release written), hf_checkpoint and a module per family (gpt2):
                       transformers' folders ~ inference/, Megatron-LM's tools/checkpoint/
    tools/             diagrams (images/gpt/), architecture_steps (notebook 11), launch_script
                       (a launch script's flags)
                       ~ Megatron-LM's tools/

Every line the notebooks read back is a :class:`~distlab.log_line.LogLine` defined in the module that
prints it (``parallel_state.BANNER``, ``training/log.ITERATION``, ...); ``distlab.logs`` imports them
from there, never the other way.
"""
