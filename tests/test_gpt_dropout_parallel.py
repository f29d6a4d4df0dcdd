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
from distlab.gpt.local_run import prepare_data
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
    from distlab.gpt.training import forward_backward

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
