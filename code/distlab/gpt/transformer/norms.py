"""The normalisation of every block and of the output: ``--normalization {LayerNorm,RMSNorm}``.

Over the last dimension of x (..., H), with eps ``--norm-epsilon``::

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta     (Ba et al. 2016; GPT-2)
    RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * gamma                     (Zhang & Sennrich 2019; Llama)

RMSNorm drops the centring and beta: one reduction instead of two, no bias. With
``--apply-layernorm-1p`` (megatron-core's ``layernorm_zero_centered_gamma``) the weight stored is
gamma - 1, initialised to 0 and applied as 1 + weight, for either norm (weight decay then pulls gamma
towards 1, not 0). ``init_parameters`` fills a norm's weight with :attr:`Norm.init_value`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Norm(nn.Module):
    """LayerNorm or RMSNorm of (..., H), ``weight`` (H,) and, for LayerNorm, ``bias`` (H,)."""

    def __init__(self, hidden_size: int, normalization: str, eps: float, zero_centered_gamma: bool) -> None:
        super().__init__()
        self.kind, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias = nn.Parameter(torch.empty(hidden_size)) if normalization == "LayerNorm" else None
        #: the stored weight that makes gamma = 1
        self.init_value = 0.0 if zero_centered_gamma else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., H)
        gamma = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.kind == "RMSNorm":
            return F.rms_norm(x, gamma.shape, gamma, self.eps)
        return F.layer_norm(x, gamma.shape, gamma, self.bias, self.eps)

    def extra_repr(self) -> str:
        one_p = ", 1p" if self.zero_centered_gamma else ""
        return f"{self.kind}({self.weight.shape[0]}, eps={self.eps}{one_p})"
