"""The course's GPT on ``torch.distributed.pipelining``: stages, PyTorch's schedules, one step.

With L blocks over S stages (``S = pp`` for GPipe and 1F1B; ``S = v pp`` for the interleaved
schedules, rank r holding stages r, r + pp, ...), stage s holds blocks ``[s L / S, (s + 1) L / S)``
(``gpt_model.GPTModel`` with pp = S, keyed by their global index, so every stage draws the weights of
one process), the first also the embeddings, the last the final LayerNorm and its own copy of E::

    stage 0      tokens (b, T) -> h (b, T, H)
    stage s      h -> h
    stage S - 1  h -> logits (b, T, V);  loss_fn(logits, labels) = mean cross-entropy

A schedule's ``step`` cuts the batch into m micro-batches, runs every forward and backward in its
order (batched p2p between neighbouring ranks), and divides the gradients by m: the gradient of
the batch's mean loss. The two copies of E get their summed gradient here (one all-reduce between
the first and the last stage's rank, ``distributed/gradients.py``'s tied-embedding sum), then AdamW steps.
Notebook 05's hand-written GPipe and 1F1B (``pipeline_parallel/schedules.py``) do the same with named
communication steps; here PyTorch's schedule objects do. :func:`compare_schedules` runs both on
the same batches, timing each step, with the hand-written engine's measured bubble
(``pipeline_timeline``: 1 - busy / (p x span) of the last step) and, for the interleaved
schedules, the ideal bubble of the action order PyTorch's schedule object runs (:func:`ideal_bubble`).

The ideal bubble, in Qi et al.'s model (Zero Bubble Pipeline Parallelism, arXiv 2401.10241, ICLR
2024): a stage's backward is split into B, the input gradient (PyTorch's ``I``), and W, the weight
gradient; T_F = T_B = T_W = 1 per chunk, messages free, one synchronised step. Each of p ranks
computes 3 v m units; the step lasts 3 v m + (idle units), and

    GPipe, 1F1B                (p - 1) / (m + p - 1)         idle 3 (p - 1): F + B + W per stage
    interleaved 1F1B           (p - 1) / (v m + p - 1)       idle 3 (p - 1) chunk units
    interleaved zero-bubble    (p - 1) / (3 v m + p - 1)     idle p - 1 chunk units

(the orders torch 2.14's interleaved schedules run give exactly these, :func:`order_bubble`:
``tests/test_gpt_torch_pipelining.py``).
The zero-bubble line is Qi et al.'s ZB-H1 bubble (p - 1)(T_F + T_B - T_W), one third of 1F1B's,
over v chunks: ``ScheduleInterleavedZeroBubble`` is their ZB1P, whose W passes fill the drain but
whose in-flight micro-batches (1F1B's memory) leave the ramp. No bubble at all needs both more and
less than this schedule: more warm-up forwards (ZB-H2/ZB2P, up to 2p - 1 micro-batches of
activations) or a V placement (ZBV, PyTorch's ``ScheduleZBVZeroBubble``), equal T_F, T_B and T_W,
and no synchronisation at the optimizer step (their post-validation of the gradient norm and the
inf/nan check), so that one step's drain overlaps the next step's fill.
"""

from __future__ import annotations

import json
import math
import os
import re
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

from distlab.distributed import init_distributed, shutdown
from distlab.gpt.layout import Layout
from distlab.gpt.model_layout import ModelShape, model_layout_errors
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pipeline_parallel.p2p_communication import P2PSpec
from distlab.gpt.pipeline_parallel.schedules import PipelineForwardBackward
from distlab.gpt.pipeline_parallel.timeline import PipelineTimeline
from distlab.gpt.training.training import LocalBackend, train_step
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_ranks import free_port, torchrun_env

#: Name -> (schedule class, stages per rank).
SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "interleaved_zero_bubble": (ScheduleInterleavedZeroBubble, 2),
}
#: Notebook 05's hand-written schedules (``pipeline_parallel/schedules.py``): name -> (its schedule, v).
HAND_WRITTEN = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "interleaved_1f1b": ("1f1b", 2)}


#: Cost of PyTorch's compute actions in units of T_F = T_B = T_W: forward, input gradient (Qi et
#: al.'s B), weight gradient (W), and the full backward of the other schedules (B + W).
ACTION_UNITS = {"F": 1, "I": 1, "W": 1, "B": 2}
_ACTION_RE = re.compile(r"^(\d+)([FIWB])(\d+)$")  # str(_Action): stage, kind, micro-batch ("2I0")


def order_bubble(pipeline_order: dict[int, list]) -> float:
    """1 - busy / (p x span) of a schedule's order run as fast as its dependencies allow.

    ``pipeline_order``: rank -> its actions in order (a schedule object's ``pipeline_order``, or
    their strings, ``"2F0"``: stage 2's forward of micro-batch 0); ``None`` and the
    non-compute actions (REDUCE_GRAD, sends, receives) are skipped. Each compute action costs
    :data:`ACTION_UNITS` and starts when its rank has finished the previous one and its input
    exists: F of stage s after F of s - 1; I or B of stage s after I or B of s + 1 (the last
    stage: after its own F); W after its I. Messages cost nothing. Raises ``ValueError`` on an
    order that waits for itself.
    """
    actions = {
        rank: [(int(m[1]), m[2], int(m[3])) for m in (_ACTION_RE.match(str(a)) for a in acts if a) if m]
        for rank, acts in pipeline_order.items()
    }
    kinds = {(s, mb): k for acts in actions.values() for s, k, mb in acts if k in "IB"}  # backward kind
    last = max(s for acts in actions.values() for s, _, _ in acts)

    def inputs(s: int, kind: str, mb: int) -> list[tuple[int, str, int]]:
        if kind == "F":
            return [(s - 1, "F", mb)] if s > 0 else []
        if kind == "W":
            return [(s, "I", mb)]
        return [(s, "F", mb)] + ([(s + 1, kinds.get((s + 1, mb), "B"), mb)] if s < last else [])

    end: dict[tuple[int, str, int], float] = {}
    free, done = dict.fromkeys(actions, 0.0), dict.fromkeys(actions, 0)
    moved = True
    while moved:
        moved = False
        for rank, acts in actions.items():
            while done[rank] < len(acts) and all(d in end for d in inputs(*acts[done[rank]])):
                s, kind, mb = acts[done[rank]]
                start = max([free[rank]] + [end[d] for d in inputs(s, kind, mb)])
                end[s, kind, mb] = free[rank] = start + ACTION_UNITS[kind]
                done[rank] += 1
                moved = True
    stuck = {rank: acts[done[rank]] for rank, acts in actions.items() if done[rank] < len(acts)}
    if stuck:
        raise ValueError(f"the order waits for itself: next actions {stuck}")
    busy = sum(ACTION_UNITS[k] for acts in actions.values() for _, k, _ in acts)
    return 1.0 - busy / (len(actions) * max(free.values()))


def ideal_bubble(schedule: PipelineScheduleSingle | PipelineScheduleMulti) -> float | None:
    """:func:`order_bubble` of the order a multi-stage schedule's ``step`` runs (its
    ``pipeline_order``), None for ``ScheduleGPipe`` and ``Schedule1F1B``: their ``step`` runs a
    loop of its own, and their ``pipeline_order`` only describes it (in torch 2.14 the 1F1B one
    even skips stage 1's micro-batch 0); their bubble is the closed form (p - 1)/(m + p - 1)."""
    return order_bubble(schedule.pipeline_order) if isinstance(schedule, PipelineScheduleMulti) else None


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
    stage_layout = Layout(num_stages, pp=num_stages)  # each stage a GPTModel of its L / stages blocks
    if errors := model_layout_errors(ModelShape.of(cfg), stage_layout):
        raise ValueError(f"{schedule} on {pp} ranks runs {num_stages} stages: " + "; ".join(errors))
    stages = []
    for s in range(rank, num_stages, pp):  # rank r: stages r, r + pp, ...
        gpt = GPTModel(cfg, ParallelState(stage_layout, rank=s)).to(device)
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


def hand_written_steps(
    cfg: GPTConfig, name: str, batches: list[tuple[torch.Tensor, torch.Tensor]], m: int, lr: float
) -> dict:
    """The engine's own schedule ``name`` (:data:`HAND_WRITTEN`) over the world's ranks, one AdamW
    step per (tokens, labels) batch (b m, T) cut into m micro-batches, no clipping (as
    :func:`train_steps`): ``{"losses", "step_ms", "bubble"}``, the bubble measured on the last step."""
    schedule, v = HAND_WRITTEN[name]
    pp, (bm, seq) = dist.get_world_size(), batches[0][0].shape
    layout = Layout(pp, pp=pp, vp=v, micro_batch_size=bm // m, global_batch_size=bm)
    state = ParallelState.build(layout)  # collective: every rank
    device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.get_default_device()
    model = GPTModel(cfg, state).to(device)
    timeline = PipelineTimeline(state.pp_rank, pp, device, group=state.pp_group)
    spec = P2PSpec((bm // m, seq, cfg.hidden_size), torch.float32, device, timeout_s=60)  # (b, T, H)
    fb = PipelineForwardBackward(state, spec, schedule=schedule, timeline=timeline, chunks=v)
    backend = LocalBackend(model, torch.optim.AdamW(model.parameters(), lr=lr), state, clip_grad=math.inf)
    losses, step_ms = [], []
    for tokens, labels in batches:
        start = time.perf_counter()
        micro = list(zip(tokens.chunk(m), labels.chunk(m), strict=True))  # m x ((b, T), (b, T))
        losses.append(float(train_step(backend, micro, state=state, forward_backward_fn=fb).loss))
        step_ms.append(1000 * (time.perf_counter() - start))
    return {"losses": losses, "step_ms": step_ms, "bubble": timeline.gather()["measured_bubble"]}


def _schedules_rank(rank: int, port: int, cfg: GPTConfig, batches: list, m: int, out: str) -> None:
    os.environ.update(torchrun_env(rank, 2, port))
    torch.set_num_threads(1)  # the two ranks share the notebook's cores
    ctx = init_distributed("gloo")
    results: dict[str, dict] = {"torch": {}, "hand_written": {}}
    for name in SCHEDULES:
        stages = build_stages(cfg, name, ctx.device)
        step_s: list[float] = []
        schedule = build_schedule(stages, name, m)
        losses = train_steps(stages, schedule, batches, 1e-2, step_s)
        results["torch"][name] = {
            "losses": losses,
            "step_ms": [1000 * s for s in step_s],
            "ideal_bubble": ideal_bubble(schedule),
        }
    for name in HAND_WRITTEN:
        results["hand_written"][name] = hand_written_steps(cfg, name, batches, m, 1e-2)
    if rank == 1:  # the last stage's rank
        Path(out, "schedules.json").write_text(json.dumps(results))
    shutdown()


def compare_schedules(cfg: GPTConfig, batches: list, num_micro_batches: int) -> dict:
    """Every schedule on 2 spawned gloo ranks, PyTorch's and the engine's: ``{"torch": {name:
    {"losses", "step_ms", "ideal_bubble"}}, "hand_written": {name: {"losses", "step_ms",
    "bubble"}}}``, per step; ``ideal_bubble`` is :func:`ideal_bubble` (None for GPipe and 1F1B)."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(
            _schedules_rank, args=(free_port(), cfg, batches, num_micro_batches, out), nprocs=2, join=True
        )
        return json.loads(Path(out, "schedules.json").read_text())
