"""What the optimizer is built from: megatron-core's ``OptimizerConfig``, the fields used here.

Field names and defaults are megatron-core's (``megatron/core/optimizer/optimizer_config.py``);
the precision and its loss scale are :class:`~distlab.gpt.optimizer.precision.Precision`'s.
Built from the command line once, by ``arguments/to_configs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The optimizers built here (``--optimizer``): Megatron's ``adam`` decouples weight decay (AdamW).
OPTIMIZERS = ("adam", "adamw", "sgd")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, its learning rates and constants, gradient clipping, and whether its state is
    sharded (the distributed optimizer)."""

    lr: float
    """Peak learning rate (the schedule's ``max_lr``)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    decoupled_lr: float | None = None
    """Peak learning rate of the input embedding and the output layer; None: ``lr``, one group."""
    decoupled_min_lr: float | None = None
    """Their final learning rate; None: ``min_lr`` (as Megatron)."""
    weight_decay: float = 0.01
    """Decoupled weight decay, on every parameter but biases and norms."""
    optimizer: str = "adam"
    """adam (AdamW), adamw, or sgd."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: fp32 main parameters and moments sharded over dp x cp
    (``optimizer/distrib_optimizer.py``), built with a ``DistributedDataParallelConfig``."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
