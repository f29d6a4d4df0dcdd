"""GPipe and 1F1B on a toy stack of layers against one process; timeline order and plot; the
GPT's residual stream between two stages under --bf16.

The toy model has the GPT's shape of problem: a tied matrix W used by the first stage
(h = x W) and the last (out = h W^T), L tanh-linear layers between, an MSE loss per
micro-batch. One group of 4 gloo processes runs every layout and schedule.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from distlab.distributed import DistContext
from distlab.gpt.arguments import PretrainArgs
from distlab.gpt.arguments.to_configs import model_config, precision_config
from distlab.gpt.build import build_forward_backward
from distlab.gpt.distributed.gradients import reduce_gradients
from distlab.gpt.layout import Layout
from distlab.gpt.optimizer.optimizer import build_optimizer
from distlab.gpt.optimizer.optimizer_config import OptimizerConfig
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pipeline_parallel.p2p_communication import P2PSpec
from distlab.gpt.pipeline_parallel.plot import plot_timelines
from distlab.gpt.pipeline_parallel.schedules import forward_backward_pipeline
from distlab.gpt.pipeline_parallel.timeline import (
    PipelineTimeline,
    measured_bubble,
    save_timeline,
    theoretical_bubble,
)
from distlab.gpt.training.training import LocalBackend, train_step
from distlab.gpt.transformer.gpt_model import GPTModel
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(240)

D, L, MB = 8, 4, 2  # width, layers, micro-batch size


def make_data(dp: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + m)
    return torch.randn(dp, m, MB, D, generator=g), torch.randn(dp, m, MB, D, generator=g)


def reference(dp: int, m: int) -> tuple[nn.Module, torch.Tensor]:
    """One process: loss = mean over replicas and micro-batches; returns model and losses (dp, m)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"w": nn.Linear(D, D, bias=False), **{str(i): nn.Linear(D, D) for i in range(L)}})
    X, Y = make_data(dp, m)
    losses = torch.zeros(dp, m)
    for d in range(dp):
        for i in range(m):
            h = X[d, i] @ model["w"].weight
            for j in range(L):
                h = torch.tanh(model[str(j)](h))
            losses[d, i] = F.mse_loss(h @ model["w"].weight.T, Y[d, i])
    losses.mean().backward()
    return model, losses.detach()


class Stage(nn.Module):
    """Layers [s L/p, (s+1) L/p) and, on the first / last stage, a copy of the tied W."""

    def __init__(self, ref: nn.Module, state: ParallelState, X: torch.Tensor, Y: torch.Tensor) -> None:
        super().__init__()
        self.state, self.X, self.Y = state, X, Y
        per = L // state.pp
        self.ids = [str(j) for j in range(state.pp_rank * per, (state.pp_rank + 1) * per)]
        self.layers = nn.ModuleDict({j: nn.Linear(D, D) for j in self.ids})
        for j in self.ids:
            self.layers[j].load_state_dict(ref[j].state_dict())
        self.w = None
        if state.is_first_stage or state.is_last_stage:  # each end holds a copy of the tied W
            self.w = nn.Parameter(ref["w"].weight.detach().clone())

    def forward(self, x: torch.Tensor | None, i: int) -> torch.Tensor:
        s = self.state
        h = self.X[s.dp_rank, i] @ self.w if s.is_first_stage else x
        for j in self.ids:
            h = torch.tanh(self.layers[j](h))
        return F.mse_loss(h @ self.w.T, self.Y[s.dp_rank, i]) if s.is_last_stage else h


def order(events: list[dict], stage: int) -> list[str]:
    return [f"{e['kind']}{e['mb']}" for e in sorted(events, key=lambda e: e["start"]) if e["stage"] == stage]


def run_layout(pp: int, m: int, schedule: str, out: Path) -> None:
    state = ParallelState.build(Layout(dist.get_world_size(), pp=pp))
    dp = state.dp
    ref, ref_losses = reference(dp, m)
    X, Y = make_data(dp, m)
    stage = Stage(ref, state, X, Y)
    timeline = PipelineTimeline(state.pp_rank, pp, group=state.pp_group)
    losses = forward_backward_pipeline(
        lambda x, i: stage(x, i),
        num_microbatches=m,
        state=state,
        schedule=schedule,
        spec=P2PSpec((MB, D), torch.float32, torch.device("cpu"), timeout_s=60),
        timeline=timeline,
    )
    reduce_gradients(stage.parameters(), stage.w, state)  # sum W's two gradients, average over dp

    what = f"pp={pp} dp={dp} m={m} {schedule} rank {state.rank}"
    if state.is_last_stage:
        assert_close(torch.stack(losses), ref_losses[state.dp_rank], msg=lambda s: f"{what}: losses {s}")
    else:
        assert losses == [], what
    for j in stage.ids:
        assert_close(
            stage.layers[j].weight.grad, ref[j].weight.grad, msg=lambda s, j=j: f"{what}: layer {j} {s}"
        )
        assert_close(stage.layers[j].bias.grad, ref[j].bias.grad)
    if stage.w is not None:
        assert_close(stage.w.grad, ref["w"].weight.grad, msg=lambda s: f"{what}: tied W grad {s}")

    tl = timeline.gather()
    mine = order(tl["events"], state.pp_rank)
    assert sorted(mine) == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]), (what, mine)
    if schedule == "gpipe":
        assert mine == [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)], (what, mine)
    else:  # warm-up forwards, then alternate, then cool-down backwards; few activations alive
        warm = min(pp - state.pp_rank - 1, m)
        first = min(warm + 1, m)
        assert mine[:first] == [f"F{i}" for i in range(first)], (what, mine)
        alive = peak = 0
        for ev in mine:
            alive += 1 if ev[0] == "F" else -1
            peak = max(peak, alive)
        assert peak <= min(pp - state.pp_rank, m), (what, mine, peak)
    assert 0.0 <= tl["measured_bubble"] < 1.0
    assert tl["theoretical_bubble"] == pytest.approx((pp - 1) / (m + pp - 1))
    if state.rank == 0:
        save_timeline(tl, out / f"{schedule}-pp{pp}-m{m}.json")


def _worker(ctx: DistContext, out: str) -> None:
    for schedule in ("gpipe", "1f1b"):
        run_layout(4, 6, schedule, Path(out))  # p=4: 1F1B has 3, 2, 1, 0 warm-up forwards
        run_layout(4, 2, schedule, Path(out))  # fewer micro-batches than stages
        run_layout(2, 4, schedule, Path(out))  # pp=2 x dp=2: gradients averaged after the schedule
    dist.barrier()


def test_schedules_match_single_process_and_plot(tmp_path: Path) -> None:
    run_gloo(_worker, 4, str(tmp_path))
    saved = sorted(tmp_path.glob("*.json"))
    assert len(saved) == 6
    png = tmp_path / "timeline.png"
    plot_timelines([tmp_path / "gpipe-pp4-m6.json", tmp_path / "1f1b-pp4-m6.json"], png)
    assert png.stat().st_size > 10_000
    tl = json.loads((tmp_path / "1f1b-pp4-m6.json").read_text())
    assert len(tl["events"]) == 4 * 2 * 6


def completes_in_order(a: list[list[str]], b: list[list[str]]) -> bool:
    """NCCL's rule for one pair of ranks: each runs its batches in order, and a batch finishes only
    together with the peer's current batch, when its sends meet that batch's receives one to one."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i].count("isend") != b[j].count("irecv") or a[i].count("irecv") != b[j].count("isend"):
            return False  # both wait for an operation the other has queued behind its own
        i, j = i + 1, j + 1
    return i == len(a) and j == len(b)


def _record_batches(ctx: DistContext, out: str) -> None:
    """1F1B on p=2, m=4 (one warm-up forward on stage 0, three steady 1F1B steps), recording
    every ``batch_isend_irecv`` call: the list of (operation, peer) it posts."""
    posted, real = [], dist.batch_isend_irecv

    def recording(ops):
        posted.append([(op.op.__name__, op.peer) for op in ops])
        return real(ops)

    dist.batch_isend_irecv = recording
    try:
        state = ParallelState.build(Layout(dist.get_world_size(), pp=2))
        ref, _ = reference(1, 4)
        X, Y = make_data(1, 4)
        stage = Stage(ref, state, X, Y)
        spec = P2PSpec((MB, D), torch.float32, torch.device("cpu"), timeout_s=60)
        forward_backward_pipeline(stage, num_microbatches=4, state=state, spec=spec, schedule="1f1b")
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, posted)
        if ctx.rank == 0:
            Path(out, "posted.json").write_text(json.dumps(gathered))
    finally:
        dist.batch_isend_irecv = real


def test_1f1b_posts_each_neighbour_exchange_as_one_batch(tmp_path: Path) -> None:
    """The steady state's exchanges (stage 0: y out, dy in; stage 1: dx out, next x in) are one
    batch each, the order NCCL completes; posted one by one, irecv first, they would deadlock."""
    run_gloo(_record_batches, 2, str(tmp_path))
    first, last = json.loads((tmp_path / "posted.json").read_text())
    both = [["isend", 1], ["irecv", 1]]
    assert first == [[["isend", 1]], both, both, both, [["irecv", 1]]], first
    both = [["isend", 0], ["irecv", 0]]
    assert last == [[["irecv", 0]], both, both, both, [["isend", 0]]], last
    kinds = [[[op for op, _ in batch] for batch in ranks] for ranks in (first, last)]
    assert completes_in_order(*kinds)
    one_by_one = [[[op] for batch in ranks for op in sorted(batch)] for ranks in kinds]
    assert one_by_one[0][1:3] == [["irecv"], ["isend"]]  # the unbatched order: irecv, then isend
    assert not completes_in_order(*one_by_one)


def test_bubble_formulas() -> None:
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(1, 8) == 0.0
    # An ideal 2-stage, 2-micro-batch GPipe step (t_f = t_b = 1): 4 busy of 6 slots per stage.
    ev = [
        {"stage": 0, "start": 0, "end": 1},
        {"stage": 0, "start": 1, "end": 2},
        {"stage": 1, "start": 1, "end": 2},
        {"stage": 1, "start": 2, "end": 3},
        {"stage": 1, "start": 3, "end": 4},
        {"stage": 1, "start": 4, "end": 5},
        {"stage": 0, "start": 4, "end": 5},
        {"stage": 0, "start": 5, "end": 6},
    ]
    assert measured_bubble(ev, 2) == pytest.approx(theoretical_bubble(2, 2))
    with pytest.raises(ValueError, match="no timeline events"):
        measured_bubble([], 2)


def test_bad_schedule_is_named() -> None:
    with pytest.raises(
        ValueError, match="--pipeline-schedule 'zigzag' is unknown: choose one of gpipe, 1f1b"
    ):
        forward_backward_pipeline(
            lambda x, i: x,
            num_microbatches=1,
            state=None,
            spec=P2PSpec((1,), torch.float32, torch.device("cpu")),
            schedule="zigzag",
        )


def _residual_stream_worker(ctx: DistContext, out: str) -> None:
    """The GPT on pp 2 under --bf16, without and with --fp32-residual-connection, through the
    driver's pieces (``precision_config``, ``model_config``, ``build_forward_backward``): the
    dtype of each stage's first block input (stage 0: the embeddings' output; stage 1: what
    stage 0 sent), the pipeline's message dtype and four 1F1B steps' losses on one batch."""
    state = ParallelState.build(Layout(2, pp=2, micro_batch_size=2, global_batch_size=8))
    tokens = torch.randint(0, 256, (4, 2, 17), generator=torch.Generator().manual_seed(0))  # m x (b, T + 1)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]  # tokens, labels: (b, T) each
    results = {}
    for flag in (False, True):
        args = PretrainArgs(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                            max_position_embeddings=16, micro_batch_size=2, bf16=True, attention_dropout=0.0,
                            hidden_dropout=0.0, fp32_residual_connection=flag)  # fmt: skip
        precision = precision_config(args)
        model = GPTModel(model_config(args, 256), state)
        seen: list[str] = []
        first = next(iter(model.layers.values()))
        first.register_forward_pre_hook(
            lambda m, a, kw, seen=seen: seen.append(str(a[0].dtype)), with_kwargs=True
        )
        run = build_forward_backward(args, state, ctx.device, None, precision.residual_dtype)
        backend = LocalBackend(model, build_optimizer(model, OptimizerConfig(lr=1e-2)), state, clip_grad=1.0)
        amp = functools.partial(precision.autocast, ctx.device)
        steps = [
            train_step(backend, batches, state=state, autocast=amp, forward_backward_fn=run) for _ in range(4)
        ]
        results[str(flag)] = {"inputs": sorted(set(seen)), "messages": str(run.spec.dtype),
                              "losses": [float(r.loss) for r in steps]}  # fmt: skip
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(results))


def test_gpt_residual_stream_between_stages_follows_fp32_residual_connection(tmp_path: Path) -> None:
    """Under --bf16 both stages' blocks receive a bf16 residual stream and the stages exchange
    bf16; with --fp32-residual-connection fp32 (Megatron's pipeline_dtype, overridden to fp32).
    Both train: four steps on one batch lower the loss, to nearly the same values."""
    run_gloo(_residual_stream_worker, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for flag, dtype in (("False", "torch.bfloat16"), ("True", "torch.float32")):
        for rank in ranks:
            assert rank[flag]["inputs"] == [dtype] and rank[flag]["messages"] == dtype, (flag, rank[flag])
        losses = ranks[1][flag]["losses"]
        assert ranks[0][flag]["losses"] == losses and all(map(math.isfinite, losses)), losses
        assert losses[-1] < losses[0] - 0.3, losses
    assert_close(ranks[1]["True"]["losses"], ranks[1]["False"]["losses"], rtol=2e-2, atol=0)
