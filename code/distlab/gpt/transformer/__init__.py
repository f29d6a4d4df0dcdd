"""The GPT itself: blocks, one pipeline stage, what a block keeps for its backward (Megatron Core's
``transformer/`` and ``models/gpt/``)."""
