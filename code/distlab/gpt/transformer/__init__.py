"""The GPT itself: blocks (transformer_layer), one pipeline stage (gpt_model), what a block keeps
for its backward, mixture of experts (Megatron Core's ``transformer/`` and ``models/gpt/``)."""
