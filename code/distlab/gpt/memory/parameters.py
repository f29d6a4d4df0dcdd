"""Parameters on a rank, for the memory estimate: one block (GPT-2 or Llama, dense or MoE), the
first pipeline stage (the blocks, the embeddings, the final norm and an untied output layer).

Torch-free, as ``memory_estimate``.
"""

from __future__ import annotations

from distlab.gpt.memory.setup import MemorySetup


def num_parameters(L: int, h: int, V: int, s: int) -> int:
    """Parameters of the whole GPT: 12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h)) + 2h (final LN)."""
    return L * (12 * h * h + 13 * h) + (V + s) * h + 2 * h


def layer_parameters(c: MemorySetup) -> tuple[int, int]:
    """One dense block's parameters (split over tp, replicated on every tp rank). GPT-2:
    (12 h^2 + 7 h, 6 h): qkv, proj, fc1, fc2 weights, qkv and fc1 biases; proj and fc2 biases and
    two LayerNorms. Llama: qkv h (a + 2g) d, proj a d h, the MLP 3 h F (SwiGLU), no biases, two
    RMSNorm weights (``transformer/config.py``)."""
    h, a = c.hidden_size, c.num_attention_heads
    d = c.kv_channels or h // a
    g = c.num_query_groups or a
    f = c.ffn_hidden_size or 4 * h
    fc1 = 2 * f if c.swiglu else f  # [gate; up] with SwiGLU
    split = h * (a + 2 * g) * d + a * d * h + h * fc1 + f * h
    replicated = 2 * _norm_parameters(c)
    if c.add_bias_linear:
        split += (a + 2 * g) * d + fc1
        replicated += 2 * h
    elif c.add_qkv_bias:
        split += (a + 2 * g) * d
    return split, replicated


def _norm_parameters(c: MemorySetup) -> int:
    return 2 * c.hidden_size if c.normalization == "LayerNorm" else c.hidden_size


def _mlp_parameters(c: MemorySetup) -> int:
    """One MLP's parameters on a rank, split over tp but for fc2's bias (GPT-2: (8 h^2 + 4 h) / tp + h)."""
    h, f = c.hidden_size, c.ffn_hidden_size or 4 * c.hidden_size
    split = (3 if c.swiglu else 2) * h * f + ((2 * f if c.swiglu else f) if c.add_bias_linear else 0)
    return split // c.tp + (h if c.add_bias_linear else 0)


def block_parameters(c: MemorySetup) -> int:
    """One block's parameters on a rank: split / tp + replicated (an MoE block: its router and
    E / ep experts, each split over tp as the MLP)."""
    split, replicated = layer_parameters(c)
    layer = split // c.tp + replicated
    if c.num_experts is not None:  # the MLP -> router E h + E / ep experts, each split over tp as the MLP
        layer += c.num_experts * c.hidden_size + (c.num_experts // c.ep - 1) * _mlp_parameters(c)
    return layer


def expert_parameters(c: MemorySetup) -> int:
    """The experts' parameters on the first stage's rank, (L / pp) (E / ep) MLPs split over tp (0
    without MoE): with ep > 1 the distributed optimizer shards them over dp x cp / ep ranks only."""
    return (c.num_layers // c.pp) * (c.num_experts // c.ep) * _mlp_parameters(c) if c.num_experts else 0


def stage_parameters(c: MemorySetup) -> int:
    """Parameters on the first pipeline stage's rank (it holds the embeddings): matrices / tp."""
    h = c.hidden_size
    vocab = c.vocab_size * h // vocab_split(c)
    n = (c.num_layers // c.pp) * block_parameters(c) + vocab
    n += c.seq_length * h if c.position_embedding_type == "learned_absolute" else 0
    if c.pp == 1:  # also the last stage: the final norm and an untied output layer
        n += _norm_parameters(c) + (vocab if c.untie_embeddings_and_output_weights else 0)
    return n


def vocab_split(c: MemorySetup) -> int:
    """Ranks the embedding and the logits are split over: tp (Megatron's vocab-parallel), or 1 (DTensor's plan)."""
    return 1 if c.tensor_parallel_impl == "dtensor" else c.tp
