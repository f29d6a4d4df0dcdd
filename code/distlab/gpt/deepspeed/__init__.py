"""DeepSpeed ZeRO as a back end: its JSON config and its engine (Megatron-DeepSpeed)."""
