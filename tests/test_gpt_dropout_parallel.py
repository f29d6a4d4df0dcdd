"""Dropout under tensor and sequence parallelism: which ranks draw equal masks, which other ones.

Megatron-LM's rule (``tensor_parallel/random.py``): the default generator is the same on the tp
ranks (seed + 100 pp_rank) and drops out what they hold alike (the replicated hidden states
outside the tp regions); a second, model-parallel stream (seed + 2718 + tp_rank, forked with
``RNGStatesTracker.fork``) drops out what each rank holds alone: its own heads' attention
probabilities, and with sequence parallelism its own T / tp positions. Checked on real gloo
ranks with the whole engine (``build_run``): a replicated parameter's gradient is the same on
every tp rank, attention masks differ across tp ranks, recomputation replays both streams.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab.distributed import DistContext
from distlab.gpt.arguments import parse_args, validate_args
from distlab.local_runs import prepare_data
from tests.conftest import TINY_GPT_ARGV, run_gloo

pytestmark = pytest.mark.timeout(240)

TP2 = ["--tensor-model-parallel-size", "2"]
DROPOUT = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2", "--attention-backend", "unfused"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=40).argv()


def _build(ctx: DistContext, argv: list[str]):
    from distlab.gpt.build import build_run

    args = parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        return build_run(args, validate_args(args, ctx.world_size), ctx)


def _replicated_grads(ctx: DistContext, argv: list[str]) -> dict[str, list[float]]:
    """One forward and backward of the step's micro-batches; each plain (replicated) parameter's
    gradient, with its largest difference to tp rank 0's."""
    from distlab.gpt.training.training import forward_backward

    run = _build(ctx, argv)
    run.model.train()
    batches = run.batches(run.datasets[0], 0, run.layout.num_micro_batches)
    run.backend.zero_grad()
    forward_backward(run.model, batches, backward=run.backend.backward, autocast=run.autocast)
    out = {}
    for name, p in run.model.named_parameters():
        if p.grad is None or hasattr(p.grad, "placements"):  # DTensor gradients: sharded or Partial
            continue
        grads = [torch.empty_like(p.grad) for _ in range(run.state.tp)]
        dist.all_gather(grads, p.grad.contiguous(), group=run.state.tp_group)
        out[name] = [float((g - grads[0]).abs().max()) for g in grads] + [float(grads[0].abs().max())]
    return out


def _grads_worker(ctx: DistContext, argv: list[str], out: str) -> None:
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(_replicated_grads(ctx, argv)))


def test_replicated_gradients_are_equal_on_the_tp_ranks_with_dtensor_sp_and_dropout(data, tmp_path) -> None:
    """The embeddings and the final LayerNorm are whole on every tp rank under DTensor SP: their
    gradients must be the same there, dropout or not (else the replicas drift apart)."""
    argv = [*TINY_GPT_ARGV, *data, *TP2, "--tensor-parallel-impl", "dtensor", "--sequence-parallel", *DROPOUT]
    run_gloo(_grads_worker, 2, argv, str(tmp_path), timeout_s=200)
    diffs = json.loads((tmp_path / "rank0.json").read_text())
    assert {"wte.weight", "wpe.weight", "ln_f.weight"} <= diffs.keys()
    for name, (*per_rank, size) in diffs.items():
        assert size > 0, f"{name}: no gradient"
        assert max(per_rank) == 0.0, f"{name}: the tp ranks' gradients differ by {max(per_rank):.3g}"


def _masks_worker(ctx: DistContext, argv: list[str], out: str) -> None:
    """Every dropout mask of one forward (the first micro-batch), gathered from the tp ranks:
    per call, whether the tp ranks' masks are equal, and the mask's rank (4: attention
    probabilities (b, n / tp, T, T), 3: hidden states (b, T, H) or (b, T / tp, H))."""
    import torch.nn.functional as F

    run = _build(ctx, argv)
    run.model.train()
    masks = []
    dropout = F.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        y = dropout(x, p, training, inplace)
        if training and p > 0:
            masks.append(((y == 0) & (x != 0), float(((y == 0) & (x != 0)).sum() / (x != 0).sum())))
        return y

    F.dropout = recording
    try:
        tokens, labels = run.batches(run.datasets[0], 0, 1)[0]
        run.model(tokens, labels)
    finally:
        F.dropout = dropout
    calls = []
    for mask, dropped in masks:  # the causal mask's zeros are not dropped out
        both = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(run.state.tp)]
        dist.all_gather(both, mask.to(torch.uint8).contiguous(), group=run.state.tp_group)
        calls.append(
            {
                "dim": mask.dim(),
                "equal": bool(torch.equal(both[0], both[1])),
                "dropped": dropped,
            }
        )
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(calls))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_attention_masks_differ_across_tp_ranks_hidden_masks_follow_the_layout(data, tmp_path, sp) -> None:
    """Each tp rank holds other heads: their attention-dropout masks must differ (one process
    holding all heads would not draw the same mask twice). Without SP the hidden states after g
    are the same (b, T, H) on every tp rank: one mask, equal there; with SP each rank holds
    other positions: different masks."""
    argv = [*TINY_GPT_ARGV, *data, *TP2, *DROPOUT, *(["--sequence-parallel"] if sp else [])]
    run_gloo(_masks_worker, 2, argv, str(tmp_path), timeout_s=200)
    calls = json.loads((tmp_path / "rank0.json").read_text())
    attention = [c for c in calls if c["dim"] == 4]
    hidden = [c for c in calls if c["dim"] == 3]
    assert len(attention) == 4 and len(hidden) == 1 + 2 * 4  # 4 blocks; embeddings + 2 per block
    assert all(0.1 < c["dropped"] < 0.3 for c in calls), calls  # p = 0.2
    assert not any(c["equal"] for c in attention), "attention masks are equal on the tp ranks"
    assert all(c["equal"] != sp for c in hidden), (
        f"hidden-state masks should be {'different' if sp else 'equal'} on the tp ranks: {hidden}"
    )


RECOMPUTE = {
    "selective": ["--recompute-granularity", "selective"],
    "full": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "2",
    ],
}


def _recompute_worker(ctx: DistContext, argv: list[str], out: str) -> None:
    """Every parameter's gradient of one forward and backward without recomputation and with
    each mode (each run seeded alike by build_run): the largest difference to the plain run's."""
    from distlab.gpt.training.training import forward_backward

    grads = {}
    for mode, flags in {"none": [], **RECOMPUTE}.items():
        run = _build(ctx, [*argv, *flags])
        run.model.train()
        batches = run.batches(run.datasets[0], 0, run.layout.num_micro_batches)
        run.backend.zero_grad()
        forward_backward(run.model, batches, backward=run.backend.backward)
        grads[mode] = {k: p.grad.clone() for k, p in run.model.named_parameters()}
    diffs = {mode: max(float((g[k] - grads["none"][k]).abs().max()) for k in g) for mode, g in grads.items()}
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(diffs))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_recomputation_replays_both_random_streams(data, tmp_path, sp) -> None:
    """Recomputing blocks (full) or the core attention (selective) draws the masks of the forward
    again, from the default and the model-parallel stream: the gradients are the plain run's."""
    argv = [*TINY_GPT_ARGV, *data, *TP2, *DROPOUT, *(["--sequence-parallel"] if sp else [])]
    run_gloo(_recompute_worker, 2, argv, str(tmp_path), timeout_s=200)
    for rank in range(2):
        diffs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for mode in RECOMPUTE:
            assert diffs[mode] < 1e-6, (
                f"rank {rank}, {mode} recomputation: gradients differ by {diffs[mode]:.3g}"
            )


def test_a_checkpoints_rng_state_holds_the_model_parallel_stream() -> None:
    """A resumed run draws the masks the uninterrupted one would: ``checkpointing.rng_state``
    keeps the tracker's stream, ``set_rng_state`` restores it (``tracker=False`` leaves it)."""
    from distlab.gpt.checkpointing import checkpointing
    from distlab.gpt.tensor_parallel.rng_tracker import get_rng_tracker, model_parallel_manual_seed

    model_parallel_manual_seed(7, tp_rank=1)
    with get_rng_tracker().fork():
        torch.rand(3)  # the stream has moved on from its seed
    saved = checkpointing.rng_state()
    with get_rng_tracker().fork():
        expected = torch.rand(5), torch.rand(2)
    default = torch.rand(4)
    checkpointing.set_rng_state(saved)
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(5), expected[0])
        with get_rng_tracker().fork():  # nested: the same stream goes on
            assert torch.equal(torch.rand(2), expected[1])
    assert torch.equal(torch.rand(4), default)  # the default stream, untouched by the forks
    model_parallel_manual_seed(7, tp_rank=0)
    checkpointing.set_rng_state(saved, tracker=False)
    with get_rng_tracker().fork():
        assert not torch.equal(torch.rand(5), expected[0])  # tp rank 0's own stream
