"""The core's optimizer builders and FLOP counts called with the arguments, for ``planning/``,
which plans from a command line: each maps ``args`` through ``to_configs`` and calls the core
function of the same name (``optimizer/``, ``distributed/``, ``training/flops.py``), which takes
configs. A run maps its configs once, in ``build.py``, and calls the core directly.
"""

from __future__ import annotations

import torch
from torch import nn

from distlab.gpt.arguments.groups import PretrainArgs
from distlab.gpt.arguments.to_configs import ddp_config, flops_config, optimizer_config
from distlab.gpt.optimizer import distrib_optimizer, optimizer
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training import flops


def build_optimizer(model: nn.Module, args: PretrainArgs) -> torch.optim.Optimizer:
    """``optimizer.build_optimizer`` with the arguments' ``OptimizerConfig``."""
    return optimizer.build_optimizer(model, optimizer_config(args))


def build_distributed_optimizer(
    model: nn.Module, state: ParallelState, args: PretrainArgs, dtype: torch.dtype
) -> distrib_optimizer.DistributedOptimizer:
    """``distrib_optimizer.build_distributed_optimizer`` with the arguments' optimizer and DDP configs."""
    return distrib_optimizer.build_distributed_optimizer(
        model, state, optimizer_config(args), ddp_config(args), dtype
    )


def model_flops_per_iteration(args: PretrainArgs, vocab_size: int) -> float:
    """``flops.model_flops_per_iteration`` of the arguments' model and batch, V = ``vocab_size``."""
    return flops.model_flops_per_iteration(flops_config(args, vocab_size))


def output_layer_flops(args: PretrainArgs, vocab_size: int) -> float:
    """``flops.output_layer_flops`` of the arguments' model and batch, V = ``vocab_size``."""
    return flops.output_layer_flops(flops_config(args, vocab_size))


def recomputed_layers(args: PretrainArgs) -> int:
    """``flops.recomputed_layers`` of the arguments (the vocabulary plays no part: one row)."""
    return flops.recomputed_layers(flops_config(args, vocab_size=1))
