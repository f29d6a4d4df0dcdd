"""DeepSpeed's JSON config for the course's GPT, checked before anything starts (torch-free).

DeepSpeed's batch rule::

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size
    e.g.      16     =                 2               x              4              x     2

Only data parallelism (tp = pp = 1): Megatron-DeepSpeed's pipeline engine is not this course's.
The run decides the batch keys the file leaves out; the ones it gives must agree. fp32 only: an
``fp16`` or ``bf16`` section that is enabled is refused (the engine's own ``--fp16`` runs the same
dynamic loss scaling, Megatron's flags for DeepSpeed's ``initial_scale_power``,
``loss_scale_window`` and ``hysteresis``). The runtime
(``deepspeed.initialize`` and the step) is in ``engine.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from distlab.log_line import LogLine, Opt

#: ``offload``: "optimizer", "param" or "optimizer and param".
DEEPSPEED = LogLine(
    "> deepspeed: ZeRO stage {stage:d}",
    Opt(", offload {offload} to cpu"),
    " | train_batch_size {train_batch_size:d} = micro {micro_batch:d} x accumulation {accumulation:d} "
    "x world size",
)

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
    halves = [k for k in ("fp16", "bf16") if config.get(k, {}).get("enabled") not in (None, False)]
    if halves:
        raise ValueError(
            f'{name} enables "{halves[0]}": DeepSpeed runs in fp32 in this course (the memory lines and '
            f'the step assume fp32 weights); set its "enabled" to false, or train with the engine\'s '
            f"--{halves[0]} without --deepspeed (fp16's initial_scale_power p is --initial-loss-scale 2^p, "
            f"its loss_scale_window and hysteresis are --loss-scale-window and --hysteresis)"
        )
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
    return DEEPSPEED.format(
        stage=zero.get("stage", 0),
        offload=" and ".join(offload) or None,
        train_batch_size=config["train_batch_size"],
        micro_batch=config["train_micro_batch_size_per_gpu"],
        accumulation=config["gradient_accumulation_steps"],
    )
