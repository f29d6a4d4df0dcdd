"""The trained model leaves the course: text generation with a KV cache, and checkpoints to and
from Hugging Face transformers (Megatron Core's ``inference/``, Megatron-LM's ``tools/checkpoint/``).

    kv_cache.py           every block's keys and values so far: a constant cost per new token
    generation.py         greedy, temperature, top-k, top-p; the loop with or without the cache
    architecture.py       the record one model family fills; families.py lists them
    gpt2.py               the course GPT <-> GPT2LMHeadModel, weight by weight
    llama.py              the course's Llama <-> LlamaForCausalLM (RoPE's rotate-half, GQA, SwiGLU)
    mixtral.py            the course's Llama-MoE <-> MixtralForCausalLM (router, experts' w1/w3/w2)
    course_checkpoint.py  a course checkpoint of any layout read whole; a release one written
    hf_checkpoint.py      a transformers folder (config, safetensors, tokenizer) written and read

The entry scripts are ``code/generate.py`` and ``code/convert_checkpoint.py``.
"""
