"""MFU and HFU, named as the papers name them: the step's FLOPs over the devices' peak.

With f one block's forward per token, attention's Q K^T and scores times V counted at the causal
half (``2 s n d`` where ``training/flops.py`` counts ``4 s n d``), l blocks, r of them recomputed,
B sequences of s tokens, the output layer ``6 h V`` a token::

    model FLOPs      F_model = B s (3 l f + 6 h V)              no recomputation counted
    hardware FLOPs   F_hw    = F_model + B s r f                 + the recomputed forward
    MFU = F_model / (W peak t),   HFU = F_hw / (W peak t)        W devices, t seconds a step

MFU is PaLM's (Chowdhery et al. 2022) with causal attention as Megatron-LM's current
``num_floating_point_operations`` counts it (megatron/training/training.py: "causal mask (only
half of the mask is non-zero)"); for GPT-3's blocks ``72 B s l h^2 (1 + s/(12h) + V/(12lh))``.
HFU adds what recomputation reruns, as Korthikanti et al. (2022) report both. Without
recomputation the two are equal.
"""

from __future__ import annotations

from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.from_args import recomputed_layers
from distlab.gpt.arguments.to_configs import flops_config
from distlab.gpt.training import flops

MFU_CONVENTION = "MFU: model FLOPs, no recomputation, causal attention at half (Megatron-LM)"
HFU_CONVENTION = "HFU: MFU's FLOPs + the recomputed forward (Korthikanti et al. 2022)"


def causal_layer_flops_per_token(args: PretrainArgs, vocab_size: int) -> float:
    """f: one block's forward per token with attention at the causal half, ``flops``' count less
    ``2 s n d``."""
    config = flops_config(args, vocab_size)
    nd = config.model.num_attention_heads * config.model.head_dim
    return flops.layer_forward_flops_per_token(config) - 2 * args.seq_length * nd


def model_flops(args: PretrainArgs, vocab_size: int) -> float:
    """F_model = B s (3 l f + 6 h V): MFU's numerator, a step's forward and backward once."""
    tokens = float(args.global_batch_size * args.seq_length)
    layers = tokens * 3 * args.num_layers * causal_layer_flops_per_token(args, vocab_size)
    return layers + 6.0 * tokens * args.hidden_size * vocab_size


def hardware_flops(args: PretrainArgs, vocab_size: int) -> float:
    """F_hw = F_model + B s r f: HFU's numerator, with the forward that recomputation reruns."""
    tokens = float(args.global_batch_size * args.seq_length)
    rerun = tokens * recomputed_layers(args) * causal_layer_flops_per_token(args, vocab_size)
    return model_flops(args, vocab_size) + rerun
