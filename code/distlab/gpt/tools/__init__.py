"""Pictures and scripts around the engine, for the notebooks (Megatron-LM's ``tools/``); the
spawned local runs of tests and benchmarks are ``distlab.local_runs``."""
