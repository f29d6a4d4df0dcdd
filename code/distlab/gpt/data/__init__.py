"""Data: the tokenizer, the memory-mapped indexed dataset and GPT samples (Megatron Core's ``datasets/`` and ``tokenizers/``)."""
