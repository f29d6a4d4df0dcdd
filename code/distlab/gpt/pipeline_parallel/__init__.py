"""Pipeline parallelism: p2p communication, schedules, interleaving, timelines (Megatron Core's
``pipeline_parallel/``)."""
