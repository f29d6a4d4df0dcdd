"""The normalisation of every block and of the output: ``--normalization {LayerNorm,RMSNorm}``.

Over the last dimension of x (..., H), with eps ``--norm-epsilon``::

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta     (Ba et al. 2016; GPT-2)
    RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * gamma                     (Zhang & Sennrich 2019; Llama)

RMSNorm drops the centring and beta: one reduction instead of two, no bias. With
``--apply-layernorm-1p`` (megatron-core's ``layernorm_zero_centered_gamma``) the weight stored is
gamma - 1, initialised to 0 and applied as 1 + weight, for either norm (weight decay then pulls gamma
towards 1, not 0). ``init_parameters`` fills a norm's weight with :attr:`Norm.init_value`.

Dtypes: a norm reads the residual stream in its dtype (the training dtype, or fp32 with
``--fp32-residual-connection``), computes in that dtype, its weights cast to it (Megatron's are
in its params dtype; the kernels accumulate in fp32), and returns the dtype the layers compute
in, :func:`compute_dtype`, as Megatron's norms hand its params dtype to the GEMM that follows.
Autocast is off inside: CUDA's runs ``layer_norm`` in fp32 and would keep an fp32 copy of a half
input for backward. Backward keeps LayerNorm's input, in its dtype, and its mean and 1 / std per
token; PyTorch's ``F.rms_norm`` on the CPU (no fused kernel there) keeps an fp32 copy of a half
input and the fp32 normalised input, 8 bytes per value whatever the input's dtype.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """Autocast's dtype where it is on for ``device_type`` (--bf16 / --fp16), else None (the
    meta device has no autocast)."""
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def compute_dtype(device_type: str, weights: torch.dtype) -> torch.dtype:
    """The dtype the layers compute in: autocast's where it is on (over fp32 weights), else
    ``weights``, the dtype of the weights as they are used (FSDP2's bf16 parameters, a dry run's
    half model, fp32)."""
    return autocast_dtype(device_type) or weights


class Norm(nn.Module):
    """LayerNorm or RMSNorm of (..., H), ``weight`` (H,) and, for LayerNorm, ``bias`` (H,)."""

    def __init__(self, hidden_size: int, normalization: str, eps: float, zero_centered_gamma: bool) -> None:
        super().__init__()
        self.kind, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias = nn.Parameter(torch.empty(hidden_size)) if normalization == "LayerNorm" else None
        #: the stored weight that makes gamma = 1
        self.init_value = 0.0 if zero_centered_gamma else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., H) in the residual stream's dtype -> (..., H) in :func:`compute_dtype`,
        computed in x's dtype."""
        amp = autocast_dtype(x.device.type)
        gamma = (self.weight + 1 if self.zero_centered_gamma else self.weight).to(x.dtype)  # (H,)
        with torch.autocast(x.device.type, enabled=False) if amp else contextlib.nullcontext():
            if self.kind == "RMSNorm":
                y = F.rms_norm(x, gamma.shape, gamma, self.eps)
            else:
                y = F.layer_norm(x, gamma.shape, gamma, self.bias.to(x.dtype), self.eps)
        return y.to(amp or self.weight.dtype)  # (..., H)

    def extra_repr(self) -> str:
        one_p = ", 1p" if self.zero_centered_gamma else ""
        return f"{self.kind}({self.weight.shape[0]}, eps={self.eps}{one_p})"
