"""Rotary position embedding (RoFormer, Su et al. 2021): ``--position-embedding-type rope``.

A head's first d_rot = d x ``--rotary-percent`` channels are cut in pairs, and pair i of the
token at position m is rotated by the angle m theta_i, theta_i = base^(-2i / d_rot),
base = ``--rotary-base``; the other d - d_rot channels pass as they are. Applied to q and k (not v),
a rotation by m theta and one by m' theta leave q.k a function of m - m' only: attention sees
relative positions, and nothing is added to the residual stream.

**Which channels pair up: rotate-half.** Megatron-core (``rope_utils._rotate_half`` with
``rotary_interleaved=False``, its default) pairs channel i with channel i + d_rot / 2::

    x = [x1, x2] (two halves)    rotate_half(x) = [-x2, x1]
    angles = [m theta, m theta]  (the d_rot / 2 angles twice, ``torch.cat((freqs, freqs))``)
    rope(x) = x cos(angles) + rotate_half(x) sin(angles)

Hugging Face's Llama (``modeling_llama.rotate_half``, ``apply_rotary_pos_emb``) computes the same
thing, so a converted checkpoint needs no permutation of its q and k rows for RoPE's sake (the
original RoFormer and Meta's first release rotate interleaved pairs (2i, 2i + 1) instead:
Megatron's ``--rotary-interleaved``, not built here).

**Positions are global.** ``m`` is the token's index in the whole sequence, whatever the rank
holds: with context parallelism the two chunks ``i`` and ``2cp - 1 - i`` of this rank
(``context_parallel.positions``); with sequence parallelism attention sees the whole sequence
(after the all-gather), so 0 .. T - 1. The angles are computed once per micro-batch and stage, in
fp32, and cast to q's dtype, as Megatron does.
"""

from __future__ import annotations

import math

import torch


def rotary_angles(
    positions: torch.Tensor, rotary_dim: int, base: float, scaling_factor: float | None = None
) -> torch.Tensor:
    """positions (T,) global token indices -> angles (T, d_rot): [m theta_0 .. m theta_{d_rot/2-1}] twice;
    ``scaling_factor`` (``--use-rope-scaling``): the thetas of :func:`llama3_frequencies`."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (base**exponents)  # (d_rot / 2,): theta_i, as megatron-core's RotaryEmbedding
    if scaling_factor is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling_factor)
    freqs = torch.outer(positions.to(torch.float32), inv_freq)  # (T, d_rot / 2)
    return torch.cat((freqs, freqs), dim=-1)  # (T, d_rot)


#: Llama 3's other constants, fixed in megatron-core (``RotaryEmbedding._apply_scaling``'s defaults)
#: and in every Llama 3.1 / 3.2 ``config.json``: low_freq_factor, high_freq_factor, and the context
#: length the model was first trained at (original_max_position_embeddings).
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


def llama3_frequencies(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's RoPE frequencies (``rope_type`` llama3; megatron-core's ``_apply_scaling``,
    transformers' ``_compute_llama3_parameters``): with C = 8192 the original context and a
    wavelength 2 pi / theta, a theta whose wavelength is above C / low_freq_factor is divided by
    ``factor``, one below C / high_freq_factor stays, and in between it is interpolated:
    s = (C / wavelength - low) / (high - low), theta' = (1 - s) theta / factor + s theta."""
    low, high, context = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] along the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x (b, heads, T, d) and angles (T, d_rot), or x (b, T, heads, d) and angles (T, 1, d_rot) -> x with
    its first d_rot channels rotated, x's shape."""
    rot = angles.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # broadcast over b and the heads
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
