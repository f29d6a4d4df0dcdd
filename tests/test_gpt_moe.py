"""Mixture of experts and expert parallelism (``moe/``: router, experts, token dispatchers, layer).

Router, load-balancing loss and capacity against hand computations; dispatch and combine over
gloo with uneven splits; a tiny MoE GPT trained 3 steps with ep = 2 and ep = 4 (dp = 4, fp32,
dropless and with a capacity), with both token dispatchers (allgather, alltoall), equal to one
process holding every expert: same losses and gradient norms (1e-6) and the same tokens per
expert; and the refusals, named before compute. The compositions with tp, pp and cp run the
whole driver: ``test_gpt_moe_compositions.py``.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import MemorySetup, stage_parameters
from distlab.gpt.optimizer.optimizer import build_optimizer
from distlab.gpt.optimizer.optimizer_config import OptimizerConfig
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pretrain import MOE, log_moe
from distlab.gpt.tensor_parallel.layers import shard
from distlab.gpt.training.training import LocalBackend, train_step
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.gpt.transformer.moe.expert_parallel import combine, dispatch
from distlab.gpt.transformer.moe.experts import ExpertMLP
from distlab.gpt.transformer.moe.moe_layer import MoEConfig, moe_layers, set_aux_loss_scale, take_stats
from distlab.gpt.transformer.moe.router import load_balancing_loss, route
from distlab.logs.experts import tokens_per_expert
from tests.conftest import run_gloo

pytestmark = pytest.mark.timeout(120)

LOGITS = [[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5], [1.5, -0.5, 2.5, 0.0]]  # 3 tokens, 4 experts


def _softmax(xs: list[float]) -> list[float]:
    z = sum(math.exp(x) for x in xs)
    return [math.exp(x) / z for x in xs]


def test_route_is_softmax_over_the_top_k() -> None:
    probs, routing_map, dropped = route(torch.tensor(LOGITS), topk=2)
    chosen = [(0, 1), (1, 2), (2, 0)]  # the two largest logits of each token
    expected = torch.zeros(3, 4)
    for n, (a, b) in enumerate(chosen):
        pa, pb = _softmax([LOGITS[n][a], LOGITS[n][b]])  # softmax after the top-k (Megatron's default)
        expected[n, a], expected[n, b] = pa, pb
    torch.testing.assert_close(probs, expected)
    assert routing_map.tolist() == (expected > 0).tolist()
    assert dropped == 0


def test_load_balancing_loss_by_hand() -> None:
    E, k, N = 4, 2, 3
    scores = [_softmax(row) for row in LOGITS]  # softmax over all experts
    top = [sorted(range(E), key=lambda i, s=s: -s[i])[:k] for s in scores]
    f = [sum(i in t for t in top) / (k * N) for i in range(E)]
    P = [sum(s[i] for s in scores) / N for i in range(E)]
    expected = E * sum(fi * pi for fi, pi in zip(f, P, strict=True))
    assert float(load_balancing_loss(torch.tensor(LOGITS), k)) == pytest.approx(expected, rel=1e-6)
    # one expert certain for every token: l_aux -> E; perfectly uniform routing gives 1
    collapsed = torch.tensor([[30.0, 0.0, 0.0, 0.0]] * 8)
    assert float(load_balancing_loss(collapsed, 1)) == pytest.approx(4.0, rel=1e-6)
    balanced = torch.eye(4).repeat(2, 1) * 30.0
    assert float(load_balancing_loss(balanced, 1)) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_aux_loss_and_imbalance_are_at_most_e_over_k(k: int) -> None:
    """A token fills k different experts: f_i <= 1/k, so l_aux <= E / k and max/mean tokens <= E / k
    (E only for top-1). The bound is reached when k experts take every token and one holds the
    probability; random and adversarial logits never pass it."""
    E, N = 8, 64
    worst = torch.full((N, E), -30.0)
    worst[:, 0], worst[:, 1:k] = 30.0, 0.0  # expert 0 certain, experts 1..k-1 the next choices
    assert float(load_balancing_loss(worst, k)) == pytest.approx(E / k, rel=1e-3)
    _, routing_map, _ = route(worst, k)
    counts = routing_map.sum(0).float()
    assert float(counts.max() / counts.mean()) == pytest.approx(E / k)
    gen = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 10.0, 100.0):
        logits = scale * torch.randn(N, E, generator=gen) + torch.linspace(3.0, -3.0, E) * scale
        assert float(load_balancing_loss(logits, k)) <= E / k + 1e-5
        counts = route(logits, k)[1].sum(0).float()
        assert float(counts.max() / counts.mean()) <= E / k + 1e-6


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_aux_loss_joins_the_backward_not_the_value(scale: float) -> None:
    """Each layer's attached aux loss: backward of ``scale x mean(loss)`` equals that of
    ``scale x (mean(loss) + coeff sum l_aux)`` (scale: the step's S / m); the value stays the lm loss."""
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=4, topk=2, aux_loss_coeff=0.1)
    cfg = GPTConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=64, max_position_embeddings=8, moe=moe
    )
    model = GPTModel(cfg)
    set_aux_loss_scale(model, scale)
    tokens = torch.randint(0, 64, (2, 8))
    loss = model(tokens, tokens).mean()
    (scale * loss).backward()
    attached = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    moe.aux_loss_coeff = 0.0  # the layers share the config: nothing attached now
    plain = model(tokens, tokens).mean()
    assert float(loss.detach()) == pytest.approx(float(plain.detach()), rel=1e-7)  # no aux term in the value
    explicit = plain + 0.1 * sum(layer.aux_loss for _, layer in moe_layers(model))
    (scale * explicit).backward(retain_graph=True)
    for got, want in zip(attached, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    router = model.layers["0"].mlp.router.weight
    with_aux = router.grad.clone()
    model.zero_grad()
    (scale * plain).backward()  # without the aux loss the router's gradient differs: the term is not vacuous
    assert (with_aux - router.grad).abs().max() > 1e-5


@pytest.mark.parametrize("gated", [False, True])
def test_expert_shards_sum_to_the_whole_expert(gated: bool) -> None:
    """etp = 2: fc1 cut by output rows (gate and up halves alike when gated, stride 2), fc2 by input
    columns, fc2's bias on shard 0 only; the two partial outputs add up to the whole expert's."""
    torch.manual_seed(0)
    H, F = 8, 12
    whole = ExpertMLP(H, F, gated=gated)
    for p in whole.parameters():
        p.data.normal_(std=0.2)  # outputs of order 1, so that 1e-6 is fp32 round-off
    shards = [ExpertMLP(H, F, etp=2, etp_rank=r, gated=gated) for r in range(2)]
    for r, part in enumerate(shards):
        for p, full in zip(part.parameters(), whole.parameters(), strict=True):
            dim = getattr(p, "partition_dim", None)
            p.data.copy_(full.data if dim is None else shard(full.data, dim, 2, r, p.partition_stride))
    assert shards[0].fc1.weight.shape == ((2 if gated else 1) * F // 2, H)
    x = torch.randn(5, H)
    torch.testing.assert_close(shards[0](x) + shards[1](x), whole(x), rtol=1e-6, atol=1e-6)
    assert getattr(shards[0].fc2.bias, "sequence_parallel", False)  # its gradient summed over tp


def test_capacity_drops_the_lowest_probabilities() -> None:
    """4 tokens, 3 experts, top-2, factor 1: C = ceil(2 x 4 / 3 x 1) = 3 per expert. Every token
    has expert 0 among its two, so expert 0 drops its least confident token (p = sigmoid(0.1));
    experts 1 and 2 get two tokens each and keep them."""
    logits = torch.tensor([[2.0, 0.0, -5.0], [0.5, 0.0, -5.0], [1.0, -5.0, 0.0], [0.1, -5.0, 0.0]])
    probs, keep, dropped = route(logits, topk=2, capacity_factor=1.0)
    assert dropped == 1
    assert keep.tolist() == [
        [True, True, False],
        [True, True, False],
        [True, False, True],
        [False, False, True],
    ]
    sigmoid = [1 / (1 + math.exp(-m)) for m in (2.0, 0.5, 1.0, 0.1)]  # softmax of two = sigmoid of the gap
    assert probs[:, 0].tolist() == pytest.approx([*sigmoid[:3], 0.0])  # the dropped pair's weight is 0
    assert probs[3, 2] == pytest.approx(
        1 - sigmoid[3]
    )  # its other expert keeps its weight (no renormalising)
    _, _, none = route(logits, topk=2, capacity_factor=2.0)  # C = ceil(5.33) = 6 >= 4 tokens: room for all
    assert none == 0
    _, _, dropless = route(logits, topk=2)
    assert dropless == 0


def test_expert_groups_cut_each_data_parallel_group() -> None:
    """ep blocks of consecutive dp ranks hold all experts once; edp groups hold the same experts."""
    layout = Layout(8, tp=2, ep=2)  # dp 4: the layout docstring's example
    assert layout.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.ep_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout.edp_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    staged = Layout(8, pp=2, ep=4)  # dp 4 on each stage; experts never cross stages
    assert staged.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]] and staged.edp_groups() == [
        [r] for r in range(8)
    ]
    assert ParallelState(layout, rank=6).ep_rank == 1 and ParallelState(layout, rank=4).ep_rank == 0


# --- distributed: dispatch/combine, whole-model equivalence ------------------------------------
def _round_trip(ctx) -> None:
    """ep = 4 (world 4): rank r has 3 + 2r tokens, each routed to 2 of 8 experts; identity experts
    give back sum_e p_ne x_n, and each expert receives exactly the tokens routed to it."""
    E, ep, H = 8, 4, 3
    state = ParallelState.build(Layout(4, ep=ep))
    gen = torch.Generator().manual_seed(7)
    everyone = []
    for r in range(4):  # every rank draws every rank's tokens, to know what it should receive
        n = 3 + 2 * r
        x = torch.randn(n, H, generator=gen)
        probs, routing_map, _ = route(torch.randn(n, E, generator=gen), topk=2)
        everyone.append((x, probs, routing_map))
    x, probs, routing_map = everyone[ctx.rank]
    x.requires_grad_(True)
    inputs, plan = dispatch(x, probs, routing_map, group=state.ep_group, ep=ep)
    for j, got in enumerate(inputs):
        e = ctx.rank * (E // ep) + j
        want = torch.cat([xs[m[:, e]] for xs, _, m in everyone])  # sources in rank order
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0)
    y = combine([2.0 * chunk for chunk in inputs], plan)  # the "expert" doubles its input
    torch.testing.assert_close(y, 2.0 * probs.sum(1, keepdim=True) * x, rtol=1e-6, atol=1e-6)
    y.sum().backward()  # through both all-to-alls: d/dx = 2 sum_e p_ne
    torch.testing.assert_close(x.grad, 2.0 * probs.sum(1, keepdim=True).expand_as(x), rtol=1e-6, atol=1e-6)


B, b, T, V, STEPS = 8, 1, 8, 64, 3  # global batch B = b x dp x m = 1 x 4 x 2; 3 steps on one batch


def _train(
    state: ParallelState, capacity: float | None, data: torch.Tensor, dispatcher: str = "alltoall"
) -> dict:
    """3 steps of a 2-layer MoE GPT (8 experts, top-2, aux coeff 0.01) on the global batch ``data`` (B, T + 1)."""
    moe = MoEConfig(
        num_experts=8, topk=2, aux_loss_coeff=0.01, capacity_factor=capacity, token_dispatcher=dispatcher
    )
    cfg = GPTConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=V, max_position_embeddings=T, moe=moe
    )
    model = GPTModel(cfg, state)
    backend = LocalBackend(model, build_optimizer(model, OptimizerConfig(lr=1e-2)), state, clip_grad=1.0)
    dp, out = state.dp, {"losses": [], "norms": [], "counts": [], "aux": [], "dropped": []}
    for _ in range(STEPS):
        rows = [k * b * dp + state.dp_rank * b for k in range(B // (b * dp))]  # this rank's micro-batches
        batches = [(data[r : r + b, :-1], data[r : r + b, 1:]) for r in rows]
        result = train_step(backend, batches, state=state)
        stats = take_stats(model, state)
        out["losses"].append(float(result.loss))
        out["norms"].append(float(result.grad_norm))
        out["counts"].append([s["tokens_per_expert"] for s in stats])
        out["aux"].append([s["load_balancing_loss"] for s in stats])
        out["dropped"].append(sum(s["dropped"] for s in stats))
    return out


def _equivalence(ctx) -> None:
    data = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(3))
    single = ParallelState(Layout(1, micro_batch_size=b, global_batch_size=B), rank=0)
    states = {
        ep: ParallelState.build(Layout(4, ep=ep, micro_batch_size=b, global_batch_size=B)) for ep in (2, 4)
    }
    for capacity in (None, 1.0):
        ref = _train(single, capacity, data)  # one process, every expert, B / b micro-batches
        for (ep, state), dispatcher in itertools.product(states.items(), ("allgather", "alltoall")):
            got = _train(state, capacity, data, dispatcher)
            what = f"ep {ep} (dp 4), {dispatcher} dispatcher, capacity factor {capacity}"
            for key in ("losses", "norms", "aux"):
                torch.testing.assert_close(
                    torch.tensor(got[key], dtype=torch.float64),
                    torch.tensor(ref[key], dtype=torch.float64),
                    rtol=1e-6,
                    atol=1e-6,
                    msg=lambda m, key=key, what=what: f"{what}: {key} differ from one process: {m}",
                )
            assert got["counts"] == ref["counts"], what
            assert got["dropped"] == ref["dropped"], what
        for counts, dropped in zip(ref["counts"], ref["dropped"], strict=True):  # every pair counted once
            assert sum(map(sum, counts)) == 2 * B * T * 2 - dropped  # top-2 x B T tokens x 2 layers
        if capacity is None:
            assert ref["dropped"] == [0, 0, 0]
        else:  # C = ceil(2 x 8 / 8 x 1) = 2 slots per expert and micro-batch of 8 tokens: some drop
            assert all(d > 0 for d in ref["dropped"])
        assert ref["losses"][-1] < ref["losses"][0]  # it learns: the comparison is not vacuous


def _tensor_parallel_experts_memory(ctx) -> None:
    """tp 2 (sequence parallel) x ep 2, dp 2: the estimator's parameters per rank equal the model's,
    each of the E / ep experts split over tp (its fc2 bias whole)."""
    moe = MoEConfig(num_experts=8, topk=2)
    cfg = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=V, max_position_embeddings=T,
                    moe=moe, sequence_parallel=True)  # fmt: skip
    model = GPTModel(cfg, ParallelState.build(Layout(4, tp=2, ep=2, sequence_parallel=True)))
    setup = MemorySetup(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=T, vocab_size=V,
                        micro_batch_size=1, tp=2, dp=2, num_experts=8, ep=2, sequence_parallel=True)  # fmt: skip
    assert sum(p.numel() for p in model.parameters()) == stage_parameters(setup)
    assert model.layers["0"].mlp.experts[str(4 * (ctx.rank // 2))].fc1.weight.shape == (32, 16)  # (F / tp, H)


def _expert_parallel(ctx) -> None:
    _round_trip(ctx)
    _equivalence(ctx)
    _tensor_parallel_experts_memory(ctx)


def test_expert_parallel_over_gloo() -> None:
    """One spawn of 4 gloo ranks (spawning costs seconds): the dispatch/combine round trip with
    uneven splits, then the MoE GPT with ep = 2 and ep = 4 against one process, then the
    parameters per rank of experts split over tp against the memory estimate."""
    run_gloo(_expert_parallel, 4, timeout_s=90)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_memory_estimate_counts_a_ranks_experts(ep: int) -> None:
    """The estimator's parameters per rank equal the model's on each rank of dp = 4: E / ep experts."""
    moe = MoEConfig(num_experts=8, topk=2)
    cfg = GPTConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=V, max_position_embeddings=T, moe=moe
    )
    setup = MemorySetup(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=T, vocab_size=V,
                        micro_batch_size=1, dp=4, num_experts=8, ep=ep)  # fmt: skip
    dense_mlp = 8 * 16 * 16 + 5 * 16
    for rank in range(4):  # no process group needed: the groups stay None
        model = GPTModel(cfg, ParallelState(Layout(4, ep=ep), rank=rank))
        assert sum(p.numel() for p in model.parameters()) == stage_parameters(setup)
        assert len(model.layers["0"].mlp.experts) == 8 // ep
    assert stage_parameters(setup) - stage_parameters(
        MemorySetup(**{**setup.__dict__, "dp": 8, "ep": 8})
    ) == (2 * (8 // ep - 1) * dense_mlp)


# --- refusals, log line --------------------------------------------------------------------------
DENSE = "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 --train-iters 1 --lr 1e-3"


def _refusal(flags: str, world: int) -> str:
    with pytest.raises(ValueError) as err:
        validate_args(parse_args(f"{DENSE} {flags}".split()), world)
    return str(err.value)


@pytest.mark.parametrize(
    "flags,world,words",
    [
        ("--num-experts 6 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall", 4,
         ["--num-experts 6 is not divisible by --expert-model-parallel-size 4"]),
        ("--num-experts 4 --moe-router-topk 5", 1, ["--moe-router-topk 5", "--num-experts 4"]),
        ("--num-experts 8 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall", 2,
         ["expert-model-parallel size 4", "does not divide data-parallel size 2"]),
        ("--num-experts 4 --tensor-model-parallel-size 2", 2,
         ["--tensor-model-parallel-size 2 needs --sequence-parallel", "add --sequence-parallel"]),
        ("--num-experts 4 --tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1", 2,
         ["--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2", "etp = tp"]),
        ("--num-experts 4 --moe-router-load-balancing-type sinkhorn", 1, ["sinkhorn", "use aux_loss"]),
        ("--num-experts 4 --moe-router-load-balancing-type aux_loss seq_aux_loss", 1, ["give one"]),
        ("--num-experts 4 --moe-aux-loss-coeff 0.1 0.2", 1, ["--moe-aux-loss-coeff 0.1 0.2", "one coefficient per"]),
        ("--num-experts 4 --moe-token-dispatcher-type flex", 1, ["flex", "DeepEP"]),
        ("--num-experts 4 --ffn-hidden-size 31 --tensor-model-parallel-size 2 --sequence-parallel", 2,
         ["--ffn-hidden-size 31 is not divisible by --tensor-model-parallel-size 2 (the MLP width"]),
        ("--num-experts 4 --tensor-parallel-impl dtensor --tensor-model-parallel-size 2 --sequence-parallel", 2,
         ["--num-experts with --tensor-parallel-impl dtensor"]),
        ("--num-experts 8 --expert-model-parallel-size 8 --context-parallel-size 2", 4,
         ["expert-model-parallel size 8", "does not divide context-parallel size 2 x data-parallel size 2 = 4"]),
        ("--expert-model-parallel-size 2", 2, ["--expert-model-parallel-size 2 needs --num-experts"]),
        ("--num-experts 4 --moe-expert-capacity-factor 0", 1, ["--moe-expert-capacity-factor 0"]),
    ],
)  # fmt: skip
def test_refusals_name_the_values(flags: str, world: int, words: list[str]) -> None:
    message = _refusal(flags, world)
    for word in words:
        assert word in message, message


def test_the_driver_logs_each_layer_on_log_iterations(capsys) -> None:
    """``pretrain.log_moe``: one [moe] line per layer when due, counts of that iteration only."""
    moe = MoEConfig(num_experts=4, topk=2)
    cfg = GPTConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=V, max_position_embeddings=T, moe=moe
    )
    state = ParallelState(Layout(1), rank=0)
    run = SimpleNamespace(model=GPTModel(cfg, state), state=state, iteration=5, last_rank=True,
                          tlog=SimpleNamespace(history={}))  # fmt: skip
    tokens = torch.randint(0, V, (2, T))
    run.model(tokens, tokens).mean().backward()
    log_moe(run, due=False)  # not a log iteration: nothing printed, the counters restart
    run.model(tokens, tokens).mean().backward()
    log_moe(run, due=True)
    rows = tokens_per_expert(capsys.readouterr().out)
    assert [(r["it"], r["layer"]) for r in rows] == [(5, 0), (5, 1)]
    assert all(sum(r["counts"]) == 2 * 2 * T and r["dropped"] == 0 for r in rows)  # one forward's pairs
    assert run.tlog.history["moe"][0]["layers"][1]["tokens_per_expert"] == rows[1]["counts"]


def test_moe_line_round_trip() -> None:
    line = MOE.format(it=3, layer=1, aux=1.0123456, dropped=2, counts="58 49 85 64")
    assert line == (
        " [moe] iteration 3 | layer 1 | load_balancing_loss: 1.012346 | dropped tokens: 2 | "
        "tokens per expert: 58 49 85 64 |"
    )
    text = f"noise\n{line}\n iteration        3/      10 | lm loss: 1.0 |\n"
    assert tokens_per_expert(text) == [
        {"it": 3, "layer": 1, "aux": 1.012346, "dropped": 2, "counts": [58, 49, 85, 64]}
    ]
