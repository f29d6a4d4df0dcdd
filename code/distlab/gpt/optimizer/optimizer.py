"""Optimizer: AdamW or SGD over parameter groups, and its step (Megatron's ``optimizer/optimizer.py``;
the learning-rate schedule is in ``optimizer_param_scheduler.py``, gradient clipping in ``clip_grads.py``).

``--decoupled-lr`` / ``--decoupled-min-lr``: the input embedding and the output layer (Megatron's
``is_embedding_or_output_parameter``: the word embedding and the output weight, not the position
table) have their own ``lr_max`` / ``lr_min`` in the same warm-up and decay
(``optimizer_param_scheduler.py``).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from distlab.gpt.optimizer.optimizer_config import OptimizerConfig

#: The word embedding E and the output layer's weight (E's copy on the last stage): the
#: parameters Megatron tags ``is_embedding_or_output_parameter``.
EMBEDDING_OR_OUTPUT = ("wte.weight", "output_weight", "output_layer.weight")


def is_dtensor(t: object) -> bool:
    """``isinstance(t, DTensor)`` without importing ``torch.distributed.tensor`` (about 0.5 s, sympy
    included, in every process) in the runs that never build one: a DTensor exists only once that
    package is imported, by the native paths that make them."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def is_embedding_or_output(name: str, p: nn.Parameter) -> bool:
    return getattr(p, "is_embedding_or_output_parameter", False) or name in EMBEDDING_OR_OUTPUT


def group_key(name: str, p: nn.Parameter, config: OptimizerConfig) -> tuple[bool, bool]:
    """``p``'s parameter group: (no weight decay: biases and norms, ``decoupled_lr``'s: E and
    the output layer)."""
    no_decay = name.endswith(".bias") or ".ln" in name or name.startswith("ln")
    return no_decay, config.decoupled_lr is not None and is_embedding_or_output(name, p)


def make_optimizer(groups: dict[tuple[bool, bool], list], config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW (Megatron's ``adam`` decouples weight decay) or SGD over ``groups`` keyed by
    :func:`group_key`; each group carries its schedule's ``max_lr`` / ``min_lr``.

    Both fused (``fused=True``: one kernel over all parameters, on CPUs and GPUs alike): the
    default foreach AdamW reads every parameter's step count back to the host (two ``.item()``
    per parameter and step), and only a fused optimizer skips an update on the device
    (:func:`step_unless`). Not fused where the model mixes DTensor and plain parameters (DTensor
    tensor parallelism leaves the layers its plan does not name plain): the gradient norm, and so
    ``found_inf``, is then a plain tensor, which torch's fused kernel refuses beside DTensor
    parameters; that path keeps the foreach optimizer and its reads.
    """
    param_groups = [
        {
            "params": params,
            "weight_decay": 0.0 if no_decay else config.weight_decay,
            "max_lr": config.decoupled_lr if decoupled else config.lr,
            "min_lr": _decoupled_min_lr(config) if decoupled else config.min_lr,
        }
        for (no_decay, decoupled), params in sorted(groups.items())
    ]
    kinds = {is_dtensor(p) for g in param_groups for p in g["params"]}
    fused = None if len(kinds) > 1 else True
    c = config
    if c.optimizer in ("adam", "adamw"):
        return torch.optim.AdamW(
            param_groups, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps, fused=fused
        )
    return torch.optim.SGD(param_groups, lr=c.lr, momentum=c.sgd_momentum, fused=fused)


def _decoupled_min_lr(config: OptimizerConfig) -> float:
    """Megatron keeps the common ``min_lr`` when ``decoupled_min_lr`` is not given."""
    return config.min_lr if config.decoupled_min_lr is None else config.decoupled_min_lr


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """:func:`make_optimizer` over the model's trainable parameters."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault(group_key(name, p, config), []).append(p)
    return make_optimizer(groups, config)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group runs torch's fused kernel (which takes ``found_inf``)."""
    return all(group.get("fused") for group in optimizer.param_groups)


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()`` unless ``found_inf`` (a 0-d bool tensor), decided where it lives.

    A fused optimizer takes the flag as ``found_inf`` (as ``torch.amp.GradScaler`` hands it):
    its kernel leaves parameters, moments and step count alone when it is 1, without the host
    reading it (a ``DistributedOptimizer``'s torch optimizer over its shards alike). Any other
    optimizer (one built outside ``build_optimizer``) cannot: the flag is read (one
    synchronisation) and the step skipped on the host.
    """
    if not is_fused(optimizer):
        if not found_inf.item():
            optimizer.step()
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer of a DistributedOptimizer
    inner.found_inf = found_inf.float()
    try:
        optimizer.step()
    finally:
        del inner.found_inf
