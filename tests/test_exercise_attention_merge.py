"""Notebook 09's write-it-yourself exercise (``distlab.exercises.attention_merge``): merging two
partial attention results by their log-sum-exp.

The notebook's own cells run here: its stub says "not yet" (returns False, raises nothing); typical
wrong merges (no rescaling, an average, max or a sum for the log-sum-exp, a factor without its
trailing axis, a function that only holds for one merge) are told wrong with a hint that gives
neither the formula nor the function; the solution notebook's merge passes, its error some
orders of magnitude under the tolerance, in well under a second. The reference itself is checked:
the ring's order with the right merge is full causal attention, and the engine's ring attention
merges the same way (one process plays every rank in turn).
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from distlab import REPO_ROOT
from distlab.checks import FIXME, ExerciseError
from distlab.exercises import attention_merge

NOTEBOOK = REPO_ROOT / "notebooks" / "09_context_and_expert_parallelism.ipynb"
SOLUTION = REPO_ROOT / "solutions" / "09_context_and_expert_parallelism_solution.ipynb"
#: What a hint must not say: the merge itself, in any of the usual spellings.
ANSWER_WORDS = (
    "logaddexp",
    "exp(L1 - L",
    "exp(L2 - L",
    "exp(lse1 - lse",
    "log(exp(L1) + exp(L2))",
    "softmax(",
)


def cells(path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]


def defined(path, namespace: dict):
    source = next(c for c in cells(path) if c.startswith("def merge_partials("))
    exec(source.split("\nattention_merge.check_merge(")[0], namespace)  # the function, not the check
    return namespace["merge_partials"]


def run_check_cell(merge) -> bool:
    source = next(c for c in cells(NOTEBOOK) if c.startswith("attention_merge.check_merge("))
    namespace = {"attention_merge": attention_merge, "merge_partials": merge}
    exec(f"result = {source}", namespace)
    return namespace["result"]


def right(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2, lse


def test_the_untouched_stub_is_not_yet(capsys):
    assert run_check_cell(defined(NOTEBOOK, {"FIXME": FIXME})) is False
    assert "[not yet]" in capsys.readouterr().out

    def half_done(o1, l1, o2, l2):  # the log-sum-exp written, the output still FIXME
        return FIXME, torch.logaddexp(l1, l2)

    assert run_check_cell(half_done) is False


def without_rescaling(o1, l1, o2, l2):
    return o1 + o2, torch.logaddexp(l1, l2)


def average(o1, l1, o2, l2):
    return (o1 + o2) / 2, torch.logaddexp(l1, l2)


def max_for_lse(o1, l1, o2, l2):
    lse = torch.maximum(l1, l2)
    return torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2, lse


def sum_for_lse(o1, l1, o2, l2):
    return right(o1, l1, o2, l2)[0], l1 + l2


def no_trailing_axis(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return torch.exp(l1 - lse) * o1 + torch.exp(l2 - lse) * o2, lse


def weights_of_the_first_merge_only(o1, l1, o2, l2):
    """Right for two blocks of 7 and 4 keys, wrong along the ring: weights by block size."""
    if o1.shape[-2] == attention_merge.SHAPES["c"]:
        return right(o1, l1, o2, l2)
    return (o1 + o2) / 2, torch.logaddexp(l1, l2)


WRONG = {
    without_rescaling: attention_merge.NO_RESCALING_HINT,
    average: attention_merge.AVERAGE_HINT,
    max_for_lse: attention_merge.MAX_HINT,
    sum_for_lse: attention_merge.SUM_HINT,
    no_trailing_axis: attention_merge.SHAPE_HINT,
    weights_of_the_first_merge_only: attention_merge.RING_HINT,
}


@pytest.mark.parametrize("merge", list(WRONG), ids=lambda f: f.__name__)
def test_a_wrong_merge_gets_its_hint_and_not_the_answer(merge):
    with pytest.raises(ExerciseError) as told:
        run_check_cell(merge)
    message = str(told.value)
    assert message.endswith(WRONG[merge]), message
    assert not any(word in message for word in ANSWER_WORDS), message


def test_the_solution_passes_with_margin(capsys):
    merge = defined(SOLUTION, {"torch": torch, "attention_merge": attention_merge})
    start = time.perf_counter()
    assert run_check_cell(merge) is True
    assert time.perf_counter() - start < 2.0
    out = capsys.readouterr().out
    assert out.startswith(f"[ok] {attention_merge.NAME}: 'O within "), out
    answer, ok, _ = attention_merge.judge(merge)
    errors = [float(x) for x in re.findall(r"within ([0-9.e+-]+),? ", answer)]
    assert ok and len(errors) == 2 and max(errors) < attention_merge.TOLERANCE / 1e3, answer


def test_the_ring_order_with_the_right_merge_is_causal_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    for cp in (1, 2, 4):
        o, lse = attention_merge.ring_merged(right, q, k, v, cp=cp)
        ref_o, ref_lse = attention_merge.causal_attention(q, k, v)
        torch.testing.assert_close(o, ref_o)
        torch.testing.assert_close(lse, ref_lse)


def test_the_engines_ring_attention_merges_the_same_way(monkeypatch):
    """RingAttention.forward with one process playing every rank of cp = 4 in turn (its exchange made
    a shift of the blocks): its output is the ring order's with the learner's right merge."""
    from distlab.gpt.context_parallel import ring_attention as engine

    cp = 4
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 8 * cp, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mine = attention_merge.ring_merged(right, q, k, v, cp=cp)[0]
    chunks = [x.chunk(2 * cp, dim=2) for x in (q, k, v)]

    def local(x, i):  # rank i's tokens: chunks i and 2cp-1-i
        return torch.cat([x[i], x[2 * cp - 1 - i]], dim=2)

    for i in range(cp):
        ring = engine.Ring(None, ranks=tuple(range(cp)), index=i)
        step = iter(range(1, cp))

        def shift(ring, tensor, tag, step=step, i=i):  # the block of rank i - t, as the ring delivers it
            t = next(step)
            j = (i - t) % cp
            return [], torch.stack([local(chunks[1], j), local(chunks[2], j)])

        monkeypatch.setattr(engine, "_exchange", shift)
        monkeypatch.setattr(engine, "_wait", lambda ring, works: None)
        out = engine.RingAttention.apply(local(chunks[0], i), local(chunks[1], i), local(chunks[2], i), ring)
        expected = torch.cat([mine.chunk(2 * cp, dim=2)[c] for c in ring.chunks()], dim=2)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # the engine computes in fp32
