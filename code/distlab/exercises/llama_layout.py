"""Notebook 11's exercise: tp, cp and the distributed optimizer for a Llama within a memory budget.

The learner sees the constraint only: the model (the notebook's ``EX_ARGS``), the cluster (its ranks,
tensor parallelism inside a node) and the budget per rank in MiB, :func:`budget_mib`. The estimate of
every layout (:func:`distlab.logs.exercise.state_layout_predictions`, the ``> memory:`` line's
prediction) stays in here: the budget lies halfway between the best predicted peak without and with
``--use-distributed-optimizer`` (tp inside a node), so that a layout fits only with it. On the local
cluster (2 nodes x 2, ``EX_ARGS``'s Llama at 64 tokens) that is tp 2 with the distributed optimizer;
tp 4 would fit too, across the nodes.

:func:`check_run` recomputes the budget and the model's size and reads the run's log
(:func:`distlab.logs.exercise.check_state_layout_run`): the whole model on the world's ranks, the
predicted peak per rank within the budget, tp inside a node, trained to the last iteration.
"""

from __future__ import annotations

import shlex

from distlab.logs.exercise import check_state_layout_run, state_layout_predictions


def budget_mib(model_args: str, *, world_size: int, vocab_size: int, max_tp: int) -> int:
    """The exercise's budget per rank in MiB: halfway between the smallest predicted peak of a layout
    with tp <= ``max_tp`` without the distributed optimizer and the smallest with it (rounded)."""
    predicted = state_layout_predictions(model_args, world_size=world_size, vocab_size=vocab_size)
    best_without = min(mib for (tp, _, distopt), mib in predicted.items() if tp <= max_tp and not distopt)
    best_with = min(mib for (tp, _, distopt), mib in predicted.items() if tp <= max_tp and distopt)
    return round((best_without + best_with) / 2)


def model_parameters(model_args: str, *, vocab_size: int) -> int:
    """The parameters of the whole model ``model_args``, counted on the meta device (nothing allocated)."""
    import torch

    from distlab.gpt.arguments import parse_args
    from distlab.gpt.arguments.to_configs import model_config
    from distlab.gpt.transformer.gpt_model import GPTModel

    with torch.device("meta"):
        model = GPTModel(model_config(parse_args(shlex.split(model_args)), vocab_size))
        return sum(p.numel() for p in model.parameters())


def check_run(text: str | None, *, model_args: str, world_size: int, vocab_size: int, max_tp: int) -> bool:
    """``check`` the exercise's run from its log ``text`` (None: not run yet, "not yet") against the
    budget and the model's size this module computes."""
    return check_state_layout_run(
        text,
        world_size=world_size,
        num_parameters=model_parameters(model_args, vocab_size=vocab_size),
        budget_mib=budget_mib(model_args, world_size=world_size, vocab_size=vocab_size, max_tp=max_tp),
        max_tp=max_tp,
    )


__all__ = ["budget_mib", "check_run", "model_parameters"]
