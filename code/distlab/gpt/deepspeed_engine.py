"""DeepSpeed ZeRO for the course's GPT: config checks, ``deepspeed.initialize`` and one step.

With data parallelism over N ranks and P parameters, ZeRO (Rajbhandari et al. 2020) keeps on
each rank, for K bytes of optimizer state per parameter (Adam in fp32: K = 8)::

    stage 0   4P + 4P     + K P        every rank holds everything (plain DDP)
    stage 1   4P + 4P     + K P / N    optimizer state sharded
    stage 2   4P + 4P / N + K P / N    gradients reduce-scattered to their owner too
    stage 3   (4P + 4P + K P) / N      parameters gathered layer by layer when needed

``offload_optimizer`` keeps the optimizer state (and its step) on the CPU; ``offload_param``
(stage 3) the parameters too. DeepSpeed's batch rule, checked before anything starts::

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size
    e.g.      16     =                 2               x              4              x     2

Only data parallelism (tp = pp = 1): Megatron-DeepSpeed's pipeline engine is not this course's.
The run's own AdamW (``optimizer.build_optimizer``) is handed to DeepSpeed, so its compiled
CPU Adam is not needed (no compiler run) and every stage updates exactly as the plain run does.
``engine.backward`` divides each micro-batch loss by the accumulation steps, as
``training.forward_backward`` does; ``engine.step`` updates only at the accumulation boundary.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from distlab.gpt.training import MicroBatch, StepResult

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def refuse_model_parallel(tp: int, pp: int) -> None:
    """Raise before any compute unless tp = pp = 1, with the reason."""
    if tp != 1 or pp != 1:
        raise ValueError(
            f"--deepspeed runs data parallelism only: got --tensor-model-parallel-size {tp} and "
            f"--pipeline-model-parallel-size {pp}; set both to 1 (ZeRO shards over the data-parallel "
            f"ranks instead; Megatron-DeepSpeed's own pipeline engine is not used in this course)"
        )


def load_config(
    source: str | Path | dict,
    *,
    micro_batch_size: int,
    accumulation_steps: int,
    world_size: int,
    zero_stage: int | None = None,
    clip_grad: float | None = None,
) -> dict:
    """Read a DeepSpeed JSON config, fill what the run decides, check the batch rule.

    Batch keys missing from the file come from the run; present ones must agree with it and
    with ``train_batch_size = micro x accumulation x world size`` (all four numbers named
    otherwise). ``zero_stage`` (``--zero-stage``) overrides ``zero_optimization.stage``.
    """
    name = "the DeepSpeed config" if isinstance(source, dict) else f"DeepSpeed config {source}"
    if isinstance(source, dict):
        config = json.loads(json.dumps(source))  # a deep copy
    else:
        try:
            config = json.loads(Path(source).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--deepspeed_config {source}: {exc}") from None
    run = dict(zip(_BATCH_KEYS, (micro_batch_size * accumulation_steps * world_size, micro_batch_size,
                                 accumulation_steps), strict=True))  # fmt: skip
    given = {k: config.get(k, run[k]) for k in _BATCH_KEYS}
    total, micro, accum = (given[k] for k in _BATCH_KEYS)
    if total != micro * accum * world_size or given != run:
        raise ValueError(
            f"{name}: train_batch_size {total} must equal train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accum} x world size {world_size} = {micro * accum * world_size}"
            f", and match the run's --micro-batch-size {micro_batch_size}, accumulation steps "
            f"{accumulation_steps} (--global-batch-size {run['train_batch_size']}); fix the JSON or drop "
            f"its batch keys"
        )
    config.update(given)
    zero = config.setdefault("zero_optimization", {})
    if zero_stage is not None:
        zero["stage"] = zero_stage
    if zero.get("stage", 0) not in (0, 1, 2, 3):
        raise ValueError(f"{name}: ZeRO stage {zero.get('stage')} must be 0, 1, 2 or 3")
    if "optimizer" in config:
        raise ValueError(
            f'{name} has an "optimizer" section: remove it, the run\'s own --optimizer / --lr are used'
        )
    if clip_grad is not None:
        config.setdefault("gradient_clipping", clip_grad)
    config.setdefault("zero_allow_untested_optimizer", True)  # torch's AdamW, not DeepSpeed's
    config.setdefault("zero_force_ds_cpu_optimizer", False)  # offload with it too (no compiler)
    return config


def describe(config: dict) -> str:
    """The log line: stage, offload and the batch rule as DeepSpeed sees it."""
    zero = config.get("zero_optimization", {})
    offload = [k.removeprefix("offload_") for k in ("offload_optimizer", "offload_param") if k in zero]
    return (
        f"> deepspeed: ZeRO stage {zero.get('stage', 0)}"
        + (f", offload {' and '.join(offload)} to cpu" if offload else "")
        + f" | train_batch_size {config['train_batch_size']} = micro {config['train_micro_batch_size_per_gpu']}"
        f" x accumulation {config['gradient_accumulation_steps']} x world size"
    )


def initialize(module: nn.Module, optimizer: torch.optim.Optimizer, config: dict):
    """``deepspeed.initialize`` on the process group already started; returns the engine."""
    import deepspeed  # slow to import: only runs that ask for it pay

    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    return engine


def train_step(
    engine,
    batches: list[MicroBatch],
    *,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> StepResult:
    """Forward, ``engine.backward`` and ``engine.step`` per micro-batch; mean loss over dp."""
    total = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
    for tokens, labels in batches:
        with autocast():
            loss = engine(tokens, labels).mean()  # per-token (m, s) -> scalar
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    total /= len(batches)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
        total /= dist.get_world_size()
    loss_f = float(total)
    norm = engine.get_global_grad_norm()
    norm_f = None if norm is None else float(norm)
    skipped = not engine.was_step_applied()
    return StepResult(loss_f, norm_f, skipped=skipped, nan=not math.isfinite(loss_f))


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
