"""Interleaved 1F1B: Megatron's order, deadlock-free batched p2p, equal to one process, refusals.

The order and the rounds of point-to-point batches are pure Python: they are checked without
processes against Megatron-LM's own formulas (chunk of the k-th forward ``(k mod pv) // p``,
micro-batch ``(k // pv) p + k mod p``) and by simulating every rank's batches the way NCCL runs
them. One group of 8 gloo processes then trains a tiny GPT (8 layers) three Adam steps with
PP2 x v2 x DP4 and PP4 x v2 x DP2 against one process.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from distlab.distributed import DistContext
from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import (
    MemorySetup,
    activation_bytes,
    chunk_layers_bytes,
    chunks_in_flight,
    estimate,
    stage_layers_bytes,
)
from distlab.gpt.model_layout import ModelShape, check_model_layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pipeline_parallel.interleaved import Round, interleaved_order, p2p_plan
from distlab.gpt.pipeline_parallel.p2p_communication import P2PSpec
from distlab.gpt.pipeline_parallel.schedules import PipelineForwardBackward
from distlab.gpt.pipeline_parallel.timeline import PipelineTimeline
from distlab.gpt.training.training import LocalBackend, forward_backward, reduce_loss, train_step
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(120)

CFG = dict(num_layers=8, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16)
B_MICRO, T, STEPS, M = 2, 16, 3, 4  # micro-batch size, sequence, Adam steps, micro-batches per rank


# --- the order, without processes -------------------------------------------------------------
def megatron_order(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved order as its classic helpers state it (groups of p micro-batches)."""

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    total = v * m
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    out = [("F", chunk(k, True), microbatch(k)) for k in range(warmup)]
    for k in range(total - warmup):
        out += [("F", chunk(k + warmup, True), microbatch(k + warmup)), ("B", chunk(k, False), microbatch(k))]
    out += [("B", chunk(k, False), microbatch(k)) for k in range(total - warmup, total)]
    return out


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_order_is_megatrons(p: int, v: int, m: int) -> None:
    for rank in range(p):
        mine = [a for step in interleaved_order(p, v, m, rank) for a in step]
        assert mine == megatron_order(p, v, m, rank), (p, v, m, rank)
    # The docstring's example, spelt out.
    first = [f"{k}{c}.{i}" for step in interleaved_order(2, 2, 4, 0) for k, c, i in step]
    assert first[:6] == ["F0.0", "F0.1", "F1.0", "F1.1", "F0.2", "B1.0"]
    assert first[-4:] == ["B1.2", "B1.3", "B0.2", "B0.3"]


def simulate(p: int, v: int, m: int, forward_only: bool = False, plans: list | None = None) -> int:
    """Run every rank's rounds as NCCL does: a rank posts its next batch when its current one is
    done, a batch is done when the peers have posted each operation's counterpart, and a pair's
    operations meet in the order posted (no tags). Raises on a deadlock or on a message that
    meets the wrong one; returns the number of sends."""
    plans = plans or [p2p_plan(p, v, m, r, forward_only) for r in range(p)]
    posted = [0] * p  # batches posted so far (the current one is posted[r] - 1)
    sent, recv = defaultdict(list), defaultdict(list)  # (src, dst) -> messages in posting order

    def post(r: int) -> None:
        rnd = plans[r][posted[r]]
        for msg, peer in rnd.sends:
            sent[r, peer].append(msg)
        for msg, peer in rnd.recvs:
            recv[peer, r].append(msg)
        posted[r] += 1

    def done(r: int) -> bool:
        rnd = plans[r][posted[r] - 1]
        return all(len(recv[r, q]) >= len(sent[r, q]) for _, q in rnd.sends) and all(
            len(sent[q, r]) >= len(recv[q, r]) for _, q in rnd.recvs
        )

    for r in range(p):
        post(r)
    while not all(n == len(plans[r]) and done(r) for r, n in enumerate(posted)):
        ready = [r for r in range(p) if posted[r] < len(plans[r]) and done(r)]
        assert ready, f"p={p} v={v} m={m}: deadlock at batches {posted}"
        for r in ready:
            post(r)
    for pair, msgs in sent.items():
        assert msgs == recv[pair], f"p={p} v={v} m={m}: {pair} sends {msgs}, receives {recv[pair]}"
    return sum(len(msgs) for msgs in sent.values())


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_batched_rounds_never_deadlock(p: int, v: int) -> None:
    for m in (p, 2 * p, 4 * p):
        sends = simulate(p, v, m)
        assert sends == 2 * m * (v * p - 1)  # every virtual-stage boundary, both directions
        assert simulate(p, v, m, forward_only=True) == m * (v * p - 1)


def test_simulation_catches_a_swapped_pair() -> None:
    """With p = 2 both directions share one pair of ranks: posted gradients first, they mismatch."""
    swapped = [Round(r.sends[::-1], r.recvs) for r in p2p_plan(2, 2, 4, 0)]
    assert any(len(r.sends) == 2 for r in swapped)
    with pytest.raises(AssertionError, match="sends"):
        simulate(2, 2, 4, plans=[swapped, p2p_plan(2, 2, 4, 1)])


# --- refusals, before any compute -------------------------------------------------------------
def test_refusals_name_values_and_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="need --pipeline-model-parallel-size > 1, got 1"):
        Layout(4, pp=1, vp=2)
    with pytest.raises(ValueError, match="6 micro-batches per step .* not a multiple of 4"):
        Layout(4, pp=4, vp=2, micro_batch_size=1, global_batch_size=6)
    with pytest.raises(ValueError, match="--num-layers 6 is not divisible by .* 2 x 2 virtual stages"):
        check_model_layout(
            ModelShape(num_layers=6, hidden_size=32, num_attention_heads=4),
            Layout(4, pp=2, vp=2, global_batch_size=4),
        )

    for name in ("vocab.json", "merges.txt", "d.bin", "d.idx"):
        (tmp_path / name).write_text("")

    def argv(*extra: str) -> list[str]:
        base = "--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1"
        files = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt"),
                 "--data-path", str(tmp_path / "d")]  # fmt: skip
        return [
            *base.split(),
            *files,
            "--train-iters",
            "1",
            "--lr",
            "1e-3",
            "--global-batch-size",
            "8",
            *extra,
        ]

    args = parse_args(
        argv("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2")
    )
    assert validate_args(args, 4).vp == 2  # 8 layers / 2 stages / 2 per chunk
    args = parse_args(
        argv("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "4")
    )
    assert validate_args(args, 2).vp == 4
    bad = {
        "choose one": ("--num-layers-per-virtual-pipeline-stage", "2", "--virtual-pipeline-model-parallel-size", "2"),
        "must divide the --num-layers 8": ("--num-layers-per-virtual-pipeline-stage", "3"),
        "use --pipeline-schedule 1f1b": ("--virtual-pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"),
        "3 micro-batches per step .* not a multiple of 2": ("--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "3"),
    }  # fmt: skip
    for message, extra in bad.items():
        with pytest.raises(ValueError, match=message):
            validate_args(parse_args(argv("--pipeline-model-parallel-size", "2", *extra)), 2)
    with pytest.raises(ValueError, match="groups of p = 2, got m = 3"):
        interleaved_order(2, 2, 3, 0)


# --- the memory estimate -----------------------------------------------------------------------
def setup(**kw) -> MemorySetup:
    shape = {k: val for k, val in CFG.items() if k != "max_position_embeddings"} | kw
    return MemorySetup(**shape, seq_length=T, micro_batch_size=B_MICRO)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (4, 2, 4)])
def test_estimate_of_interleaving(p: int, v: int, m: int) -> None:
    """First stage: pp micro-batches x (1 + (pp-1)/(pp v)) of its activations, unless all its
    v m chunk-forwards fit in the warm-up (p = 4, m = 4: all 8 then)."""
    plain = setup(num_layers=16, pp=p, num_micro_batches=m)
    inter = setup(num_layers=16, pp=p, vp=v, num_micro_batches=m)
    kept = {c: chunks_in_flight(c) * chunk_layers_bytes(c) for c in (plain, inter)}  # in flight
    ratio = kept[inter] / kept[plain]  # per stage-activation of 1F1B's p
    expected = min(p * (1 + (p - 1) / (p * v)), m) / min(p, m)
    assert ratio == pytest.approx(expected)
    # the peak adds what the last block's backward holds beyond what it kept: alike in both
    assert activation_bytes(inter) - kept[inter] == pytest.approx(activation_bytes(plain) - kept[plain])
    assert chunk_layers_bytes(inter) * v == pytest.approx(stage_layers_bytes(plain))
    assert estimate(inter).parameters == estimate(plain).parameters  # the same L / pp layers
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 4 x 4 virtual stages per rank = 16"):
        setup(pp=4, vp=4, num_layers=8, num_micro_batches=4)


# --- equal to one process, on 8 ranks ---------------------------------------------------------
def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(
        0, CFG["vocab_size"], (n, B_MICRO, T + 1), generator=torch.Generator().manual_seed(7)
    )
    return [(t[:, :-1], t[:, 1:]) for t in tokens]  # (b, T) tokens, labels


class SGD:
    """p <- p - lr g: the optimizer ``LocalBackend`` steps (torch.optim's first import of dynamo
    would cost each of the 8 spawned ranks seconds of CPU)."""

    def __init__(self, params, lr: float) -> None:
        self.param_groups, self.lr = [{"params": list(params)}], lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                p -= self.lr * p.grad


def train(model: GPTModel, state: ParallelState, batches: list, fb=None) -> tuple[list, list]:
    backend = LocalBackend(model, SGD(model.parameters(), lr=0.1), state, clip_grad=1.0)
    kw = {} if fb is None else {"forward_backward_fn": fb}
    results = [train_step(backend, batches, state=state, **kw) for _ in range(STEPS)]
    return [float(r.loss) for r in results], [float(r.grad_norm) for r in results]


def run_layout(pp: int, out: Path) -> None:
    world = dist.get_world_size()
    dp = world // pp
    all_batches = data(dp * M)
    ref = [None]  # one process, on rank 0 only: losses, gradient norms, parameters after the steps
    if dist.get_rank() == 0:
        single = ParallelState(Layout(1), rank=0)
        ref_model = GPTModel(GPTConfig(**CFG), single)
        ref_run = train(ref_model, single, all_batches)
        with torch.no_grad():
            ref_eval = forward_backward(ref_model, all_batches, forward_only=True).item()
        ref = [(*ref_run, dict(ref_model.named_parameters()), ref_eval)]
    dist.broadcast_object_list(ref, src=0)
    ref_losses, ref_norms, ref_params, ref_eval = ref[0]

    layout = Layout(world, pp=pp, vp=2, micro_batch_size=B_MICRO, global_batch_size=B_MICRO * dp * M)
    state = ParallelState.build(layout)
    model = GPTModel(GPTConfig(**CFG), state)
    timeline = PipelineTimeline(state.pp_rank, pp, group=state.pp_group)
    spec = P2PSpec((B_MICRO, T, CFG["hidden_size"]), torch.float32, torch.device("cpu"), timeout_s=60)
    fb = PipelineForwardBackward(state, spec, timeline=timeline, chunks=2)
    posted, real = [], dist.batch_isend_irecv

    def recording(ops):
        posted.append(sorted((op.op.__name__, op.peer) for op in ops))
        return real(ops)

    dist.batch_isend_irecv = recording
    try:
        local = all_batches[state.dp_rank * M : (state.dp_rank + 1) * M]  # this dp rank's micro-batches
        losses, norms = train(model, state, local, fb)
    finally:
        dist.batch_isend_irecv = real
    with torch.no_grad():  # evaluation: the interleaved order's forwards only
        evaluated = float(reduce_loss(fb(model, local, forward_only=True), state))
    assert evaluated == pytest.approx(ref_eval, rel=1e-6, abs=1e-6)

    what = f"PP{pp} x v2 x DP{dp} rank {state.rank}"
    assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6, msg=lambda s: f"{what}: {s}"
    )
    assert_close(
        torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=1e-6, msg=lambda s: f"{what}: {s}"
    )
    for name, p in model.named_parameters():
        key = "wte.weight" if name == "output_weight" else name  # the last stage's copy of E
        assert_close(
            p,
            ref_params[key],
            rtol=1e-6,
            atol=1e-6,
            msg=lambda s, n=name: f"{what}: {n} after {STEPS} steps: {s}",
        )
    per = CFG["num_layers"] // (2 * pp)  # chunk c of this rank: virtual stage c pp + pp_rank
    assert [int(k) for k in model.layers] == [
        (c * pp + state.pp_rank) * per + j for c in (0, 1) for j in range(per)
    ]

    # The last step ran Megatron's order, and posted exactly the plan's batches.
    tl = timeline.gather()
    mine = [(e["kind"], e["chunk"], e["mb"]) for e in sorted(tl["events"], key=lambda e: e["start"])
            if e["stage"] == state.pp_rank]  # fmt: skip
    assert mine == megatron_order(pp, 2, M, state.pp_rank), (what, mine)
    plan = [
        sorted([("isend", state.stage_rank(q)) for _, q in r.sends] + [("irecv", state.stage_rank(q)) for _, q in r.recvs])
        for r in p2p_plan(pp, 2, M, state.pp_rank)
    ]  # fmt: skip
    plan = [b for b in plan if b]
    assert posted[-len(plan) :] == plan, what
    assert tl["theoretical_bubble"] == pytest.approx((pp - 1) / (2 * M + pp - 1))
    alive = peak = 0  # chunk-activations held between their forward and their backward
    for kind, _, _ in mine:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    if state.pp_rank == 0:  # the memory estimator's count for the first stage
        assert peak == chunks_in_flight(setup(pp=pp, vp=2, num_micro_batches=M)), (what, peak)
    if state.rank == 0:
        (out / f"pp{pp}.json").write_text(json.dumps(tl))


def _worker(ctx: DistContext, out: str) -> None:
    run_layout(2, Path(out))
    run_layout(4, Path(out))
    dist.barrier()


def test_pp2_and_pp4_interleaved_match_one_process(tmp_path: Path) -> None:
    run_gloo(_worker, 8, str(tmp_path), timeout_s=90)
    for pp in (2, 4):
        tl = json.loads((tmp_path / f"pp{pp}.json").read_text())
        assert tl["chunks"] == 2 and tl["schedule"] == "interleaved 1f1b"
        assert len(tl["events"]) == pp * 2 * 2 * M  # every rank: v m forwards and v m backwards
