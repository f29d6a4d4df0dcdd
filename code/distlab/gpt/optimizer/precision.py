"""The run's precision, decided once (``arguments/to_configs.py``): compute dtype, autocast, loss scaling.

    --fp16    fp16 autocast over fp32 weights, dynamic loss scaling (``loss_scaler.py``)
    --bf16    bf16 autocast over fp32 weights, no scaling (bf16 has fp32's exponent range)
    neither   fp32 throughout

On CPU and GPU alike the model keeps fp32 ("master") weights and the optimizer updates them;
the forward/backward compute runs under ``torch.autocast`` in fp16 or bf16. The residual stream
(the embeddings' output, the blocks' sums, the pipeline's messages) is in that half dtype, or in
fp32 with ``--fp32-residual-connection`` (:attr:`Precision.residual_dtype`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from distlab.gpt.optimizer.loss_scaler import DynamicLossScaler

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """fp32, fp16 or bf16, and fp16's loss-scaling rule (Megatron's flags)."""

    name: str = "fp32"
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    fp32_residual_connection: bool = False
    """``--fp32-residual-connection``: the residual stream in fp32 under fp16 / bf16."""

    def __post_init__(self) -> None:
        if self.name not in _DTYPES:
            raise ValueError(f"precision {self.name!r} must be one of {', '.join(_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def residual_dtype(self) -> torch.dtype:
        """The residual stream's dtype, which the pipeline stages exchange (Megatron's
        ``pipeline_dtype``, fp32 with ``fp32_residual_connection``): fp32 or the half dtype."""
        return torch.float32 if self.fp32_residual_connection else self.dtype

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """``torch.autocast`` in the run's precision, or nothing for fp32."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)

    def loss_scaler(self) -> DynamicLossScaler | None:
        """fp16's dynamic loss scaler; None for fp32 and bf16."""
        if self.name != "fp16":
            return None
        return DynamicLossScaler(
            self.initial_loss_scale, self.min_loss_scale, self.loss_scale_window, self.hysteresis
        )

    def describe(self, device: torch.device) -> str:
        """The log line that says what precision is really used."""
        if self.name == "fp16":
            return (
                f"precision: fp16 autocast on {device.type} (fp32 master weights and optimizer), dynamic "
                f"loss scaling from {self.initial_loss_scale:g} (window {self.loss_scale_window}, "
                f"hysteresis {self.hysteresis}), {self.residual_clause()}"
            )
        if self.name == "bf16":
            return (
                f"precision: bf16 autocast on {device.type} (fp32 master weights and optimizer), "
                f"no loss scaling, {self.residual_clause()}"
            )
        return f"precision: fp32 on {device.type}"

    def residual_clause(self) -> str:
        """How the start-up line names the residual stream's dtype under fp16 / bf16."""
        if self.fp32_residual_connection:
            return "residual stream in fp32 (--fp32-residual-connection)"
        return f"residual stream in {self.name}"
