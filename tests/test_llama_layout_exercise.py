"""Notebook 11's exercise: a layout for a Llama within a memory budget per rank.

The budget (between the best predicted peak without and with the distributed optimizer, tp inside
a node) leaves only tp 2 with ``--use-distributed-optimizer`` on 2 nodes x 2; the check reads a
run's log and passes only a finished run of the whole model on the 4 ranks, within the budget,
with tp inside a node (logs built from the engine's own line formats)."""

from __future__ import annotations

import shlex

import pytest
import torch

from distlab.checks import ExerciseError
from distlab.gpt.arguments import parse_args
from distlab.gpt.arguments.to_configs import model_config
from distlab.gpt.build import PARAMETERS
from distlab.gpt.layout import Layout
from distlab.gpt.memory.meters import PREDICTION
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.training.log import ITERATION
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.logs.exercise import check_state_layout_run, state_layout_predictions

#: The notebook's EX_ARGS.
EX_ARGS = (
    "--num-layers 4 --hidden-size 128 --ffn-hidden-size 448 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --kv-channels 32 --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope "
    "--swiglu --normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear "
    "--attention-dropout 0.0 --hidden-dropout 0.0 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --train-iters 2 --lr 1e-4 --eval-iters 0"
)


@pytest.fixture(scope="module")
def predicted() -> dict:
    return state_layout_predictions(EX_ARGS, world_size=4, vocab_size=32000)


def whole_model() -> int:
    with torch.device("meta"):
        return sum(
            p.numel() for p in GPTModel(model_config(parse_args(shlex.split(EX_ARGS)), 32000)).parameters()
        )


def budget_of(predicted: dict, max_tp: int = 2) -> int:
    """The notebook's BUDGET_MIB."""
    without = min(mib for (tp, _, d), mib in predicted.items() if tp <= max_tp and not d)
    with_it = min(mib for (tp, _, d), mib in predicted.items() if tp <= max_tp and d)
    return round((without + with_it) / 2)


def run_log(tp: int, predicted_mib: float, params_per_rank: int, last_it: int = 2) -> str:
    lines = [ParallelState(Layout(4, tp=tp), rank=0).banner()]
    lines += [PARAMETERS.format(tp_rank=r, pp_rank=0, parameters=params_per_rank) for r in range(tp)]
    lines.append(
        PREDICTION.format(predicted=predicted_mib, measured=predicted_mib + 3, how="peak RSS", error=5.0)
    )
    gbs = 4 // tp
    for it in range(1, last_it + 1):
        lines.append(ITERATION.format(it=it, total=2, samples=it * gbs, ms=90.0, lr=1e-4, gbs=gbs, loss=10.4,
                                      scale=1.0, gnorm=1.0, skipped=0, nan=0))  # fmt: skip
    return "\n".join(lines) + "\n"


def test_the_budget_leaves_only_tp2_with_the_distributed_optimizer(predicted) -> None:
    budget = budget_of(predicted)
    fits = sorted({(tp, d) for (tp, _, d), mib in predicted.items() if mib <= budget and tp <= 2})
    assert fits == [(2, True)], (budget, predicted)
    assert predicted[4, 1, False] <= budget  # tp 4 would fit: only the node boundary rules it out


def test_the_check_passes_only_the_whole_model_within_the_budget(predicted, capsys) -> None:
    n, budget = whole_model(), budget_of(predicted)
    kw = dict(world_size=4, num_parameters=n, budget_mib=budget, max_tp=2)
    assert check_state_layout_run(None, **kw) is False
    assert "[not yet]" in capsys.readouterr().out
    half = n // 2 + 4 * 2 * 128 + 128  # tp 2: half the split weights, the norms on both ranks
    assert check_state_layout_run(run_log(2, predicted[2, 1, True], half), **kw)
    wrong = {
        "tp 2 without the distributed optimizer": run_log(2, predicted[2, 1, False], half),
        "tp 4 across the nodes": run_log(4, predicted[4, 1, False], n // 4 + 2000),
        "a smaller model": run_log(2, 30.0, n // 4),
        "did not finish": run_log(2, predicted[2, 1, True], half, last_it=1),
    }
    for why, log in wrong.items():
        with pytest.raises(ExerciseError):
            check_state_layout_run(log, **kw)
            pytest.fail(why)
