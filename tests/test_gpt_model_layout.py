"""The one validation of a model against a layout (``model_layout.py``): each rule refuses with
its values and a fix, and every consumer (the arguments, the model, the memory estimate, the
planner) refuses through it what the others refuse."""

from __future__ import annotations

import pytest

from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.layout import Layout
from distlab.gpt.memory.setup import MemorySetup
from distlab.gpt.model_layout import RULES, ModelShape, check_model_layout, model_layout_errors
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.planning import hardware, planner
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel

pytestmark = pytest.mark.engine_fast

OK = ModelShape(num_layers=4, hidden_size=48, num_attention_heads=4, seq_length=16, vocab_size=96)

#: rule -> (a model, a layout that breaks it, words its message must contain)
BROKEN = {
    "head size": (dict(hidden_size=50), Layout(1), ["--hidden-size 50", "--num-attention-heads 4"]),
    "heads over tp": (dict(num_attention_heads=6), Layout(4, tp=4), ["--num-attention-heads 6", "size 4"]),
    "FFN over tp": (dict(ffn_hidden_size=50), Layout(4, tp=4), ["--ffn-hidden-size 50", "size 4"]),
    "vocabulary over tp": (dict(vocab_size=98), Layout(4, tp=4), ["vocabulary 98"]),
    "query groups against tp": (
        dict(num_attention_heads=6, num_query_groups=3),
        Layout(2, tp=2),
        ["--num-query-groups 3", "[1, 2, 6]"],
    ),
    "sequence over 2cp": (dict(seq_length=12), Layout(4, cp=4), ["--seq-length 12", "= 8"]),
    "sequence over cp x tp under SP": (
        dict(seq_length=18),
        Layout(4, tp=4, sequence_parallel=True),
        ["--seq-length 18", "multiple of 4"],
    ),
    "no attention dropout under cp": (dict(attention_dropout=0.1), Layout(2, cp=2), ["dropout 0.1"]),
    "experts over ep": (dict(num_experts=3), Layout(2, ep=2), ["--num-experts 3", "size 2"]),
    "MoE under tp needs SP": (dict(num_experts=4), Layout(2, tp=2), ["add --sequence-parallel"]),
    "layers over pp x vp": (dict(num_layers=5), Layout(2, pp=2), ["--num-layers 5", "size 2"]),
}


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_each_rule_refuses_with_its_values_and_only_it(rule: str) -> None:
    change, layout, words = BROKEN[rule]
    model = ModelShape(**{**OK.__dict__, **change})
    broken = [name for name, check in RULES.items() if check(model, layout)]
    assert broken == [rule]
    with pytest.raises(ValueError) as err:
        check_model_layout(model, layout)
    for word in words:
        assert word in str(err.value)


def test_the_rules_are_all_probed_and_hold_on_a_good_model() -> None:
    assert set(BROKEN) | {"sequence parallelism needs tp"} == set(RULES)
    assert model_layout_errors(OK, Layout(8, tp=2, cp=2, pp=2, sequence_parallel=True)) == []
    # the layout refuses SP without tp itself, before any model: the rule is its message
    with pytest.raises(ValueError, match="--sequence-parallel needs --tensor-model-parallel-size > 1"):
        Layout(2, sequence_parallel=True)


def test_the_model_refuses_layers_that_the_stages_do_not_split() -> None:
    """5 layers on pp 2 used to build blocks [0, 1] and [2, 3] and drop block 4."""
    cfg = GPTConfig(
        num_layers=5, hidden_size=16, num_attention_heads=2, vocab_size=64, max_position_embeddings=8
    )
    with pytest.raises(
        ValueError, match="--num-layers 5 is not divisible by --pipeline-model-parallel-size 2"
    ):
        GPTModel(cfg, ParallelState(layout=Layout(2, pp=2), rank=0))
    assert len(GPTModel(cfg).layers) == 5


@pytest.mark.parametrize(
    "what_if, words",
    [
        (dict(tp=3), "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
        (dict(tp=3, num_attention_heads=6, sequence_parallel=True), "--seq-length 8 is not divisible by"),
        (dict(num_experts=3, ep=2, dp=2), "--num-experts 3 is not divisible by"),
        (dict(num_experts=4, ep=2), "does not divide data-parallel size 1"),
        (dict(tp=2, num_attention_heads=6, num_query_groups=3), "--num-query-groups 3 with"),
    ],
)
def test_the_memory_estimate_refuses_what_the_engine_refuses(what_if: dict, words: str) -> None:
    base = dict(
        num_layers=2, hidden_size=48, num_attention_heads=4, seq_length=8, vocab_size=96, micro_batch_size=1
    )
    with pytest.raises(ValueError, match=words):
        MemorySetup(**{**base, **what_if})


def test_validate_args_refuses_through_the_same_rules() -> None:
    argv = "--num-layers 5 --hidden-size 48 --num-attention-heads 6 --seq-length 8 --micro-batch-size 1 "
    argv += "--lr 1e-3 --train-iters 1 --mock-data --vocab-size 96 --tokenizer-type NullTokenizer "
    argv += "--pipeline-model-parallel-size 2 --group-query-attention --num-query-groups 3 "
    argv += "--tensor-model-parallel-size 2"
    with pytest.raises(ValueError) as err:
        validate_args(parse_args(argv.split()), 4)
    model = ModelShape(num_layers=5, hidden_size=48, num_attention_heads=6, seq_length=8, num_query_groups=3)
    for error in model_layout_errors(model, Layout(4, tp=2, pp=2)):
        assert error in str(err.value)


def test_the_planner_ranks_only_what_the_engine_runs() -> None:
    args = parse_args(
        "--num-layers 6 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
        "--seq-length 1024 --max-position-embeddings 1024 --vocab-size 1000 --tokenizer-type NullTokenizer "
        "--mock-data --bf16 --lr 1e-4 --train-iters 1 --micro-batch-size 1 --global-batch-size 32 "
        "--use-distributed-optimizer".split()
    )
    refused: list[planner.Refused] = []
    found = planner.plan(args, 16, hardware.load("h100_sxm_node"), refused=refused)
    assert found and refused
    for c in found:
        lay = c.layout
        run = planner.sized(
            args, tp=lay.tp, pp=lay.pp, cp=lay.cp, micro_batch_size=lay.micro_batch_size, vp=lay.vp
        )
        assert validate_args(run, 16) == lay
    assert any(
        "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4" in r.why for r in refused
    )
    assert all(c.layout.pp != 4 for c in found)  # 6 layers do not split over 4 stages
