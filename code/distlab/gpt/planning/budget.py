"""What a plan must say before paying: time, GPU-hours and cost, then what failures take from them.

For a budget of T tokens, W GPUs, a step of t seconds over B s tokens, a price c per GPU-hour::

    time         D = T t / (B s)                    GPU-hours  G = W D / 3600,   cost = c G
    check        D ~ k T P / (W X)                  Narayanan et al. 2021, section 5.1: k = 8 with
                                                    full recomputation (X the HFU's FLOP/s), 6
                                                    without (X the MFU's); P the parameters
    failures     M = 1 / (lambda W)                 the job's mean time between interruptions,
                                                    lambda per GPU-hour; N = lambda W D' of them
    checkpoint   S = P (parameter + optimizer bytes)    C = S / storage bandwidth (a blocking save)
    interval     tau = sqrt(2 C M)                  Young 1974 (``distlab.faults``, notebook 10)
    goodput      1 - (C / tau + (tau / 2 + R) / M)  R the restart;   D' = D / goodput

lambda's default is Llama 3's: 419 unexpected interruptions in a 54-day snapshot on 16,384 H100
(Dubey et al. 2024, section 3.3.4), 1.97e-5 per GPU-hour, one every 3.1 hours for the job.
The checkpoint holds the bf16 parameters and the fp32 master copy and Adam's moments (2 + 12 bytes
a parameter, ``dry_run.STATE_BYTES``), not the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distlab import faults
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.from_args import recomputed_layers
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import MemorySetup, stage_parameters
from distlab.gpt.planning.dry_run import STATE_BYTES, precision_of
from distlab.gpt.planning.planner import Candidate
from distlab.gpt.tensor_parallel.layers import pad_vocab_size

#: Llama 3's failures (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions, 54 days, 16,384 GPUs.
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)


@dataclass(frozen=True)
class Inputs:
    """What the plan is asked for and what the hardware costs (inputs, not predictions)."""

    tokens: float
    """T, tokens to train on."""
    usd_per_gpu_hour: float
    """c, the price of one GPU for one hour."""
    storage_bytes_per_s: float
    """the bandwidth a checkpoint is written at (the whole job's, to its file system)."""
    failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    """lambda, interruptions per GPU and hour."""
    restart_s: float = 600.0
    """R, from an interruption to training again (rescheduling, loading the checkpoint)."""


@dataclass(frozen=True)
class Budget:
    """One layout's plan: ideal time and cost, the check, and the failure side."""

    days: float
    gpu_hours: float
    usd: float
    check_days: float  # k T P / (W X)
    checkpoint_bytes: float
    save_s: float  # C
    mtbf_h: float  # M
    interval_h: float  # tau
    goodput: float
    interruptions: float  # over the days with failures
    days_with_failures: float
    usd_with_failures: float


def model_parameters(args: PretrainArgs) -> int:
    """P: every parameter of the model (one rank of a layout of one GPU)."""
    vocab = pad_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1)
    one = Layout(1, micro_batch_size=1, global_batch_size=1)
    return stage_parameters(MemorySetup.from_run(args, one, vocab))


def checkpoint_bytes(parameters: float, precision: str = "bf16") -> float:
    """S = P (parameter + optimizer bytes): 14 a parameter in bf16 (2, and 12: fp32 copy, two moments)."""
    p, _, o = STATE_BYTES[precision][0]
    return parameters * (p + o)


def narayanan_seconds(tokens: float, parameters: float, gpus: int, flops_per_gpu: float, k: int = 8) -> float:
    """k T P / (W X): Narayanan et al. 2021's end-to-end time (k = 8 with recomputation, else 6)."""
    return k * tokens * parameters / (gpus * flops_per_gpu)


def goodput(save_s: float, mtbf_s: float, restart_s: float) -> tuple[float, float]:
    """(tau, 1 - lost): Young's interval sqrt(2 C M) and the share of time that trains."""
    tau = faults.young_daly_interval(save_s, mtbf_s)
    return tau, max(0.0, 1.0 - faults.lost_fraction(tau, save_s, mtbf_s, restart_s))


def budget(args: PretrainArgs, candidate: Candidate, hw_peak_flops: float, inputs: Inputs) -> Budget:
    """The plan of ``candidate`` (a layout that fits, with its prediction) for ``inputs``."""
    p, W = candidate.prediction, candidate.layout.world_size
    seconds = inputs.tokens / (p.tokens_per_s_per_device * W)
    P = model_parameters(args)
    k, utilization = (8, p.hfu) if recomputed_layers(args) else (6, p.mfu)
    check = narayanan_seconds(inputs.tokens, P, W, utilization * hw_peak_flops, k)
    size = checkpoint_bytes(P, precision_of(args))
    save = size / inputs.storage_bytes_per_s
    mtbf = 3600.0 / (inputs.failures_per_gpu_hour * W)
    tau, good = goodput(save, mtbf, inputs.restart_s)
    wall = seconds / good if good > 0 else math.inf
    hours = W * seconds / 3600
    return Budget(
        days=seconds / 86400, gpu_hours=hours, usd=hours * inputs.usd_per_gpu_hour,
        check_days=check / 86400, checkpoint_bytes=size, save_s=save, mtbf_h=mtbf / 3600,
        interval_h=tau / 3600, goodput=good, interruptions=wall / mtbf, days_with_failures=wall / 86400,
        usd_with_failures=W * wall / 3600 * inputs.usd_per_gpu_hour,
    )  # fmt: skip


def table(
    args: PretrainArgs, candidates: list[Candidate], hw_peak_flops: float, inputs: Inputs, top: int = 3
) -> list[str]:
    """The best ``top`` layouts that fit, one line each: the plan's columns, ideal | failures."""
    k = 8 if recomputed_layers(args) else 6
    lines = [
        f"{'layout':38s} {'days':>5s} {f'{k}TP/(nX)':>8s} {'GPU-hours':>9s} {'cost $':>10s} | {'ckpt TB':>7s} "
        f"{'save s':>6s} {'MTBF h':>6s} {'every h':>7s} {'goodput':>7s} {'interrupts':>10s} {'days':>5s} {'cost $':>10s}"
    ]
    for c in [c for c in candidates if c.fits][:top]:
        b = budget(args, c, hw_peak_flops, inputs)
        lines.append(
            f"{c.name():38s} {b.days:5.1f} {b.check_days:8.1f} {b.gpu_hours:9,.0f} {b.usd:10,.0f} | "
            f"{b.checkpoint_bytes / 1e12:7.2f} {b.save_s:6.0f} {b.mtbf_h:6.0f} {b.interval_h:7.1f} "
            f"{100 * b.goodput:6.1f}% {b.interruptions:10.1f} {b.days_with_failures:5.1f} {b.usd_with_failures:10,.0f}"
        )
    lines.append(
        f"(left of |: without failures, {k}TP/(nX) the check; right: with them, days / goodput; "
        f"{inputs.tokens:.3g} tokens at ${inputs.usd_per_gpu_hour:.2f} a GPU-hour)"
    )
    return lines
