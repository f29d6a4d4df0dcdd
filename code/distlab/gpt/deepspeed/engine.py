"""DeepSpeed ZeRO for the course's GPT: ``deepspeed.initialize`` and its step back end.

With data parallelism over N ranks and P parameters, ZeRO (Rajbhandari et al. 2020) keeps on
each rank, for K bytes of optimizer state per parameter (Adam in fp32: K = 8)::

    stage 0   4P + 4P     + K P        every rank holds everything (plain DDP)
    stage 1   4P + 4P     + K P / N    optimizer state sharded
    stage 2   4P + 4P / N + K P / N    gradients reduce-scattered to their owner too
    stage 3   (4P + 4P + K P) / N      parameters gathered layer by layer when needed

``offload_optimizer`` keeps the optimizer state (and its step) on the CPU; ``offload_param``
(stage 3) the parameters too. The config and its batch rule are checked before anything starts
(``config.py``).

The run's own AdamW (``optimizer.build_optimizer``) is handed to DeepSpeed, so its compiled
CPU Adam is not needed (no compiler run) and every stage updates exactly as the plain run does.

:class:`DeepSpeedBackend` plugs the engine into the one step loop (``training.train_step``):
``engine.backward`` divides each micro-batch loss by the accumulation steps, as the local back
end does, and ``engine.step`` after every micro-batch counts it and updates only at the
accumulation boundary, having reduced (ZeRO 2-3: reduce-scattered) the gradients itself.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from distlab.gpt.interfaces import StepOutcome


def initialize(module: nn.Module, optimizer: torch.optim.Optimizer, config: dict):
    """``deepspeed.initialize`` on the process group already started; returns the engine."""
    import deepspeed  # slow to import: only runs that ask for it pay

    if not torch.cuda.is_available():
        # DeepSpeed's CPU back end would JIT-compile its shared-memory all-reduce (C++ through g++
        # and ninja: minutes on 2 cores, again for every user's ~/.cache/torch_extensions) at its
        # first start. This course's CPU runs reduce through gloo: mark that op as not buildable.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine


class DeepSpeedBackend:
    """DeepSpeed's engine as a step back end (``interfaces.StepBackend``)."""

    def __init__(self, engine) -> None:
        self.engine = self.module = engine  # the forward runs through the engine

    def zero_grad(self) -> None:
        pass  # the engine zeroes its gradients after its own step

    def set_grad_sync(self, enabled: bool) -> None:
        pass  # the engine counts the micro-batches itself (engine.step below)

    def backward(self, loss: torch.Tensor, k: int, m: int) -> None:
        self.engine.backward(loss)  # loss / m; ZeRO's hooks reduce at the last micro-batch
        self.engine.step()  # counts the micro-batch; the update happens at the boundary

    def step(self) -> StepOutcome:
        norm = self.engine.get_global_grad_norm()
        norm = None if norm is None else float(norm)
        nonfinite = norm is not None and not math.isfinite(norm)
        return StepOutcome(norm, skipped=not self.engine.was_step_applied(), nonfinite=nonfinite)

    def close(self) -> None:
        self.engine.destroy()  # ZeRO's gradient hooks: reference cycles through C++ that gc cannot see


def zero_memory_stats(engine) -> dict:
    """This rank's bytes of parameters (its ZeRO-3 shard) and optimizer state, where they live."""
    params = 0
    for p in engine.module.parameters():
        held = getattr(p, "ds_tensor", p)  # stage 3: this rank's flat shard
        params += held.numel() * held.element_size()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    states = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "parameters": params,
        "optimizer_state": sum(v.numel() * v.element_size() for v in states),
        "optimizer_device": str(states[0].device) if states else "none",
    }
