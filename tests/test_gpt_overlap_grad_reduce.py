"""--overlap-grad-reduce: bucketed dp all-reduces started during backward change nothing but when.

A tiny GPT (4 layers, hidden 32) trains 3 fp32 steps at DP=4 with m=2 micro-batches of b=2
(global batch 2 x 4 x 2 = 16), once with the buckets reduced after backward and once with
overlap; both must leave bit-identical parameters, and match one process over the same 16
samples per step (m=8) to 1e-6. During the last micro-batch's backward, the first bucket's
all-reduce must already be issued when the last gradient (the embedding's) is accumulated.
Also: the bucket order, the refusals, and the trace reader that splits communication into hidden
(under backward) and exposed (after it).
"""

from __future__ import annotations

import json

import pytest
import torch

from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.distributed.grad_buckets import assign_buckets, default_bucket_size
from distlab.gpt.layout import Layout
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training.training import LocalBackend, train_step
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.profiling.traces import Trace, communication_split, step_spans
from tests.conftest import run_gloo
from tests.test_gpt_arguments import BASE, files  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(120)

CFG = GPTConfig(
    num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16
)
B, M, DP, STEPS, T = 2, 2, 4, 3, 16  # micro batch b, micro-batches m, dp, steps, sequence length
BUCKET = 5000  # elements: a block holds 12 H^2 + 13 H = 12704, so about half a block per bucket


def _data() -> torch.Tensor:
    """Every step's global batch: (STEPS, b x dp x m, T + 1) tokens."""
    return torch.randint(
        0, CFG.vocab_size, (STEPS, B * DP * M, T + 1), generator=torch.Generator().manual_seed(0)
    )


def _train(state: ParallelState, micro: list[range], *, overlap: bool, bucket_size: int | None) -> tuple:
    """STEPS steps over the sample ranges ``micro`` (one per micro-batch); (params, first-bucket flags)."""
    model = GPTModel(CFG, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # Adam would amplify round-off
    backend = LocalBackend(
        model, opt, state, clip_grad=1.0, overlap_grad_reduce=overlap, bucket_size=bucket_size
    )
    seen = []  # was bucket 0's all-reduce issued when the last gradient (wte's) was accumulated?
    model.wte.weight.register_post_accumulate_grad_hook(
        lambda _p: seen.append(backend.grad_buckets.buckets[0].work is not None)
    )
    data = _data()
    for step in range(STEPS):
        batches = [(data[step, r, :-1], data[step, r, 1:]) for r in micro]  # (b, T) each
        train_step(backend, batches, state=state)
    return [p.detach().clone() for p in model.parameters()], seen


def _dp4_rank(ctx) -> None:
    state = ParallelState.build(Layout(DP))
    r = state.dp_rank
    mine = [range(k * B * DP + r * B, k * B * DP + (r + 1) * B) for k in range(M)]  # training.micro_batches
    plain, seen_plain = _train(state, mine, overlap=False, bucket_size=BUCKET)
    overlap, seen_overlap = _train(state, mine, overlap=True, bucket_size=BUCKET)
    for a, b in zip(plain, overlap, strict=True):
        assert torch.equal(a, b), "overlapped and non-overlapped runs differ"
    # backward of micro-batch 0 only accumulates; in micro-batch 1's, bucket 0 is in flight before the end
    assert seen_overlap == [False, True] * STEPS, seen_overlap
    assert seen_plain == [False, False] * STEPS, seen_plain
    if ctx.rank == 0:
        single = ParallelState(Layout(1), rank=0)
        everything = [range(j * B, (j + 1) * B) for j in range(B * DP * M // B)]  # m = 8
        ref, _ = _train(single, everything, overlap=False, bucket_size=None)
        for a, b in zip(ref, overlap, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
        moved = max((a - b).abs().max() for a, b in zip(ref, GPTModel(CFG, single).parameters(), strict=True))
        assert moved > 1e-3, "the steps did not move the parameters: the comparison proves nothing"


def test_dp4_overlap_equals_plain_bit_for_bit_and_one_process() -> None:
    run_gloo(_dp4_rank, DP)


def test_buckets_fill_in_reverse_registration_order() -> None:
    model = GPTModel(CFG)
    params = list(model.parameters())
    buckets = assign_buckets(params, BUCKET)
    assert [id(p) for b in buckets for p in b] == [id(p) for p in reversed(params)]
    assert buckets[0][0] is model.ln_f.bias and buckets[-1][-1] is model.wte.weight
    for b in buckets[:-1]:  # closed by the parameter that reached the size, not before
        assert sum(p.numel() for p in b) >= BUCKET > sum(p.numel() for p in b[:-1])
    assert len(buckets) == 8, [sum(p.numel() for p in b) for b in buckets]
    assert len(assign_buckets(params, 10**9)) == 1
    with pytest.raises(ValueError, match="--ddp-bucket-size 0 must be"):
        assign_buckets(params, 0)


def test_default_bucket_size_is_megatrons() -> None:
    # Megatron-LM's get_model (resolve_ddp_bucket_size): max(40000000, 1000000 * dp_cp size); the
    # engine passes state.dp * state.cp (training.py)
    assert default_bucket_size(1) == default_bucket_size(40) == 40_000_000
    assert default_bucket_size(64) == 64_000_000


def test_bad_flags_are_refused_before_compute(files) -> None:  # noqa: F811 - the fixture
    with pytest.raises(ValueError, match=r"--ddp-bucket-size -5: a bucket holds a positive number"):
        validate_args(parse_args([*BASE, *files, "--ddp-bucket-size", "-5"]), 4)
    pp2 = ["--overlap-grad-reduce", "--pipeline-model-parallel-size", "2"]  # each stage's last backward
    assert validate_args(parse_args([*BASE, *files, *pp2]), 4).pp == 2  # (tests/test_gpt_pp_overlap.py)
    with pytest.raises(ValueError, match=r"--overlap-grad-reduce with --use-torch-fsdp2"):
        validate_args(parse_args([*BASE, *files, "--overlap-grad-reduce", "--use-torch-fsdp2"]), 4)
    args = parse_args([*BASE, *files, "--overlap-grad-reduce", "--ddp-bucket-size", "1000"])
    assert validate_args(args, 1).dp == 1 and args.overlap_grad_reduce  # dp 1: accepted, nothing to do


def test_communication_after_the_last_backward_is_exposed(tmp_path) -> None:
    """A synthetic trace (us): backward 0-100 on the main thread, all-reduces 60-90 (hidden) and
    95-130 (5 hidden, 30 exposed) on gloo's thread, in a 150 us step."""
    events = [
        {"ph": "X", "name": "ProfilerStep#4", "tid": 1, "ts": 1000, "dur": 150},
        {
            "ph": "X",
            "name": "autograd::engine::evaluate_function: MmBackward0",
            "tid": 1,
            "ts": 1000,
            "dur": 40,
        },
        {
            "ph": "X",
            "name": "autograd::engine::evaluate_function: AddBackward0",
            "tid": 1,
            "ts": 1030,
            "dur": 70,
        },
        {
            "ph": "X",
            "name": "autograd::engine::evaluate_function: other thread",
            "tid": 7,
            "ts": 1000,
            "dur": 140,
        },
        {"ph": "X", "name": "gloo:all_reduce", "tid": 2, "ts": 1060, "dur": 30},
        {"ph": "X", "name": "gloo:all_reduce", "tid": 2, "ts": 1095, "dur": 35},
    ]
    path = tmp_path / "rank0.1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = Trace("rank0", path, profile=None)
    (step,) = step_spans(trace)
    assert step.backward == [(0.0, 0.1)] and step.communication == [(0.06, 0.09), (0.095, 0.13)]
    split = communication_split(trace)
    assert split == pytest.approx({"hidden": 0.035, "exposed": 0.030, "step": 0.15})
