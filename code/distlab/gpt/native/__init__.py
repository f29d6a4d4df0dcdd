"""PyTorch-native parallelism: DTensor, FSDP2, torch.distributed.pipelining, torch.compile (Megatron
Core's ``distributed/torch_fully_sharded_data_parallel.py``, torchtitan's ``distributed/``)."""
