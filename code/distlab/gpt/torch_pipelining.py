"""The course's GPT on ``torch.distributed.pipelining``: stages, PyTorch's schedules, one step.

With L blocks over S stages (``S = pp`` for GPipe and 1F1B; ``S = v pp`` for the interleaved
schedules, rank r holding stages r, r + pp, ...), stage s holds blocks ``[s L / S, (s + 1) L / S)``
(``model.GPTModel`` with pp = S, keyed by their global index, so every stage draws the weights of
one process), the first also the embeddings, the last the final LayerNorm and its own copy of E::

    stage 0      tokens (b, T) -> h (b, T, H)
    stage s      h -> h
    stage S - 1  h -> logits (b, T, V);  loss_fn(logits, labels) = mean cross-entropy

A schedule's ``step`` cuts the batch into m micro-batches, runs every forward and backward in its
order (batched p2p between neighbouring ranks), and divides the gradients by m: the gradient of
the batch's mean loss. The two copies of E get their summed gradient here (one all-reduce between
the first and the last stage's rank, ``gradients.py``'s tied-embedding sum), then AdamW steps.
Notebook 05's hand-written GPipe and 1F1B (``pipeline_parallel.py``) do the same with named
communication steps; here PyTorch's schedule objects do.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from distlab.distributed import free_port, init_distributed, shutdown, torchrun_env
from distlab.gpt.layout import Layout
from distlab.gpt.model import GPTConfig, GPTModel
from distlab.gpt.parallel_state import ParallelState

#: Name -> (schedule class, stages per rank).
SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "interleaved_zero_bubble": (ScheduleInterleavedZeroBubble, 2),
}


class StageModule(nn.Module):
    """One pipeline stage of the GPT as ``PipelineStage`` calls it: one tensor in, one out."""

    def __init__(self, gpt: GPTModel) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gpt.is_first:
            return self.gpt(x)  # tokens (b, T) -> h (b, T, H), or logits when it is also the last
        self.gpt.set_input_tensor(x)  # h (b, T, H) from the previous stage
        return self.gpt(None)  # h, or logits (b, T, V) on the last stage


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of one micro-batch: logits (b, T, V), labels (b, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build_stages(cfg: GPTConfig, schedule: str, device: torch.device) -> list[PipelineStage]:
    """This rank's stages for ``schedule`` over the world's ranks (one rank per pp position)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} must be one of {list(SCHEDULES)}")
    pp, rank = dist.get_world_size(), dist.get_rank()
    num_stages = pp * SCHEDULES[schedule][1]
    if cfg.num_layers % num_stages:
        raise ValueError(
            f"--num-layers {cfg.num_layers} is not divisible by the {num_stages} stages of {schedule} on "
            f"{pp} ranks: choose a multiple of {num_stages}"
        )
    stages = []
    for s in range(rank, num_stages, pp):  # rank r: stages r, r + pp, ...
        gpt = GPTModel(cfg, ParallelState(Layout(num_stages, pp=num_stages), rank=s)).to(device)
        stages.append(PipelineStage(StageModule(gpt), s, num_stages, device))
    return stages


def build_schedule(stages: list[PipelineStage], schedule: str, num_micro_batches: int):
    """PyTorch's schedule object over this rank's stages."""
    cls, per_rank = SCHEDULES[schedule]
    if per_rank == 1:
        return cls(stages[0], n_microbatches=num_micro_batches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=num_micro_batches, loss_fn=loss_fn)


def tied_embedding_grad(stages: list[PipelineStage], ends: dist.ProcessGroup) -> None:
    """Sum E's gradients of the first and the last stage (on rank 0 and rank pp - 1)."""
    for stage in stages:
        tied = stage.submod.gpt.tied_embedding()
        if tied is not None and tied.grad is not None:
            dist.all_reduce(tied.grad, group=ends)


def train_steps(
    stages: list[PipelineStage],
    schedule: PipelineScheduleSingle | PipelineScheduleMulti,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    step_s: list[float] | None = None,
) -> list[float]:
    """One AdamW step per (tokens, labels) batch (b m, T); the last stage's rank returns each
    step's mean loss, the others an empty list. ``step_s`` collects each step's seconds."""
    ends = dist.new_group(sorted({0, dist.get_world_size() - 1}))  # collective: every rank
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr)
    first = any(stage.is_first for stage in stages)
    last = any(stage.is_last for stage in stages)
    out = []
    for tokens, labels in batches:
        start = time.perf_counter()
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses} if last else {}
        schedule.step(tokens, **kwargs) if first else schedule.step(**kwargs)
        tied_embedding_grad(stages, ends)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step_s is not None:
            step_s.append(time.perf_counter() - start)
        if last:
            out.append(float(torch.stack(losses).detach().mean()))  # m equal micro-batches: the batch's mean
    return out


def _schedules_rank(rank: int, port: int, cfg: GPTConfig, batches: list, m: int, out: str) -> None:
    os.environ.update(torchrun_env(rank, 2, port))
    torch.set_num_threads(1)  # the two ranks share the notebook's cores
    ctx = init_distributed("gloo")
    results = {}
    for name in SCHEDULES:
        stages = build_stages(cfg, name, ctx.device)
        step_s: list[float] = []
        losses = train_steps(stages, build_schedule(stages, name, m), batches, 1e-2, step_s)
        results[name] = {"losses": losses, "step_ms": [1000 * s for s in step_s]}
    if rank == 1:  # the last stage's rank
        Path(out, "schedules.json").write_text(json.dumps(results))
    shutdown()


def compare_schedules(cfg: GPTConfig, batches: list, num_micro_batches: int) -> dict:
    """Every schedule on 2 spawned gloo ranks: ``{name: {"losses", "step_ms"}}`` per step."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(
            _schedules_rank, args=(free_port(), cfg, batches, num_micro_batches, out), nprocs=2, join=True
        )
        return json.loads(Path(out, "schedules.json").read_text())
