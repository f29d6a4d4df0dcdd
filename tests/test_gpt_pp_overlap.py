"""--overlap-grad-reduce with pipeline parallelism: each stage's buckets start during the backward
of its (each model chunk's) last micro-batch, are reduced exactly once per step, and change
nothing but when.

A tiny GPT (4 layers, hidden 32) on pp 2 x dp 2 (4 gloo ranks) trains 3 steps of 16 samples (b 2,
m 4 micro-batches per rank, so the earlier backwards only accumulate), with buckets of about half a
block: plain DDP through 1F1B and through the interleaved schedule (v 2), and the distributed
optimizer with --overlap-param-gather through 1F1B. Each equals one process (m 8) within 1e-5
(losses, norms, parameters by global name) and, for 1F1B, the same run without overlap bit for
bit (the tied embedding's bucket waits for the sum of its two stages' gradients). On every rank the
data-parallel collectives of each step are exactly one per bucket, and some bucket is in flight
before the last backward ends, in that backward only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from distlab.gpt.layout import Layout
from distlab.gpt.optimizer.optimizer import build_optimizer
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pipeline_parallel.p2p_communication import P2PSpec
from distlab.gpt.pipeline_parallel.schedules import PipelineForwardBackward
from distlab.gpt.training.training import LocalBackend, train_step
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from tests.conftest import run_gloo
from tests.test_gpt_distrib_optimizer import OPTIM, distributed

pytestmark = pytest.mark.timeout(300)

CFG = GPTConfig(
    num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16
)
B, M, PP, DP, STEPS, T = 2, 4, 2, 2, 3, 16  # micro batch, micro-batches per rank, pp, dp, steps, seq
BUCKET = 5000  # elements: a block holds 12 H^2 + 13 H = 12704, so about half a block per bucket


def _data() -> torch.Tensor:
    """Every step's global batch: (STEPS, b x dp x m, T + 1) tokens."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, CFG.vocab_size, (STEPS, B * DP * M, T + 1), generator=gen)


class Collectives:
    """The data-parallel reductions issued (numel per call), over ``group``, while installed."""

    def __init__(self, group) -> None:
        self.group, self.calls = group, []
        self.real = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single")}

    def __enter__(self):
        def recording(name):
            def call(*args, **kw):
                tensor = args[1] if name == "reduce_scatter_single" else args[0]  # the bucket
                if kw.get("group") is self.group and tensor.numel() > 1:  # not the 0-d loss
                    self.calls.append((name, tensor.numel()))
                return self.real[name](*args, **kw)

            return call

        for name in self.real:
            setattr(dist, name, recording(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.real.items():
            setattr(dist, name, fn)


def _train(state: ParallelState, *, overlap: bool, adam: bool, distopt: bool = False, vp: int = 1) -> dict:
    """STEPS steps of this rank's micro-batches (Adam of OPTIM, distributed or not, else SGD):
    losses, norms, parameters by global name, the dp collectives of each step, and per backward
    of the last chunk whether a bucket was in flight."""
    model = GPTModel(CFG, state)
    if distopt:
        opt = distributed(model, state, overlap=overlap)
    elif adam:
        opt = build_optimizer(model, OPTIM)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    backend = LocalBackend(model, opt, state, clip_grad=1.0, overlap_grad_reduce=overlap, bucket_size=BUCKET)
    buckets = backend.grad_buckets
    started = (lambda: any(b.started for b in buckets.buckets)) if distopt else (lambda: any(buckets.started))
    seen: list[bool] = []  # in flight when the last chunk's first block got its gradient (late)
    first = next(list(model.layers.values())[(vp - 1) * model.per_chunk].parameters())
    first.register_post_accumulate_grad_hook(lambda _p: seen.append(started()))
    fb = {}
    if state.pp > 1:
        spec = P2PSpec((B, T, CFG.hidden_size), torch.float32, torch.device("cpu"), timeout_s=60)
        fb = {"forward_backward_fn": PipelineForwardBackward(state, spec, chunks=vp)}
    data, r, m = _data(), state.dp_rank, B * DP * M // (B * state.dp)
    mine = [range(k * B * state.dp + r * B, k * B * state.dp + (r + 1) * B) for k in range(m)]
    out = {"losses": [], "norms": [], "collectives": []}
    for step in range(STEPS):
        batches = [(data[step, s, :-1], data[step, s, 1:]) for s in mine]  # (b, T) each
        with Collectives(state.dp_cp_group if state.dp > 1 else object()) as calls:
            result = train_step(backend, batches, state=state, **fb)
        out["losses"].append(float(result.loss))
        out["norms"].append(float(result.grad_norm))
        out["collectives"].append(sorted(calls.calls))
    if distopt:
        opt.buffer.finish_param_sync()
        expected = sorted(("reduce_scatter_single", b.grad_data.numel()) for b in buckets.buckets)
    else:
        expected = sorted(("all_reduce", sum(p.numel() for p in b.params)) for b in buckets.buckets)
    out["expected"] = expected if state.dp > 1 else []
    out["seen"], out["m"] = seen, m
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _check(run: dict, ref: dict, what: str) -> None:
    """Equal to one process within 1e-5; exactly one collective per bucket per step; overlapped
    in the last backward of each step only."""
    tol = dict(rtol=1e-5, atol=1e-5, msg=lambda s: f"{what}: {s}")
    assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), **tol)
    assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), **tol)
    for name, p in run["params"].items():
        key = "wte.weight" if name == "output_weight" else name  # the last stage's copy of E
        assert_close(p, ref["params"][key], rtol=1e-5, atol=1e-5, msg=lambda s, n=name: f"{what}: {n}: {s}")
    assert run["collectives"] == [run["expected"]] * STEPS, (what, run["collectives"], run["expected"])
    assert len(run["expected"]) > 1, f"{what}: a single bucket proves no overlap"
    assert run["seen"] == ([False] * (run["m"] - 1) + [True]) * STEPS, (what, run["seen"])


def _pp2_dp2_rank(ctx) -> None:
    single = ParallelState(Layout(1), rank=0)
    ref = [None]
    if ctx.rank == 0:  # one process, m 8: SGD (plain DDP) and Adam (distributed optimizer)
        ref = [(_train(single, overlap=False, adam=False), _train(single, overlap=False, adam=True))]
    dist.broadcast_object_list(ref, src=0)
    sgd, adam = ref[0]
    moved = max((sgd["params"][n] - p).abs().max() for n, p in GPTModel(CFG, single).named_parameters())
    assert moved > 1e-3, "the steps did not move the parameters: the comparison proves nothing"

    layout = dict(micro_batch_size=B, global_batch_size=B * DP * M)
    state = ParallelState.build(Layout(PP * DP, pp=PP, **layout))
    for distopt, reference in ((False, sgd), (True, adam)):
        what = f"pp 2 x dp 2{' distributed optimizer' if distopt else ''} rank {ctx.rank}"
        overlapped = _train(state, overlap=True, adam=distopt, distopt=distopt)
        _check(overlapped, reference, what)
        plain = _train(state, overlap=False, adam=distopt, distopt=distopt)
        assert overlapped["losses"] == plain["losses"], what
        for name, p in overlapped["params"].items():
            assert torch.equal(p, plain["params"][name]), f"{what}: {name} differs without overlap"
    interleaved = ParallelState.build(Layout(PP * DP, pp=PP, vp=2, **layout))
    _check(_train(interleaved, overlap=True, adam=False, vp=2), sgd, f"pp 2 x v 2 x dp 2 rank {ctx.rank}")


def test_pp2_dp2_overlap_grad_reduce_equals_one_process() -> None:
    run_gloo(_pp2_dp2_rank, PP * DP, timeout_s=280)
