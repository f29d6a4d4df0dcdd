"""Notebook 09's exercise: merge two partial attention results by their log-sum-exp.

For one query row and a block B of keys, attention over B alone gives

    O_B = sum_{j in B} softmax_B(s)_j v_j          L_B = log sum_{j in B} exp(s_j),   s_j = q.k_j / sqrt(d)

(the block's output and its log-sum-exp, the log of the softmax's denominator over B). Ring
attention computes one such pair per K/V block as the blocks travel round the ring, and merges each
into what it has; the learner writes that merge, ``merge(O1, L1, O2, L2) -> (O, L)`` for two
disjoint blocks, shapes (b, n, c, d) and (b, n, c).

:func:`check_merge` judges it in this process, in float64, against attention over all the keys at
once: first two blocks of a non-causal attention, then full causal attention over a sequence cut
as the engine cuts it for cp = 4 (chunks i and 2cp-1-i) and merged in the engine's ring order
(rank i, step t: the chunks of rank i - t; a pair of chunks skipped when fully masked), against
``scaled_dot_product_attention(is_causal=True)``. The engine's own merge is in
:class:`distlab.gpt.context_parallel.ring_attention.RingAttention`; the notebook shows it after the
exercise. A wrong answer is told which part is off (O or L) and, for the usual mistakes (no
rescaling, an average, max or a sum for L), why, without the formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from distlab.checks import FIXME, check, untouched
from distlab.gpt.context_parallel.ring_attention import Ring

NAME = "merging two partial attention results"
TOLERANCE = 1e-9
"""Largest absolute error accepted (float64: a right merge is off by ~1e-15 after the ring's
merges, a wrong one by 1e-2 or more)."""
CP = 4  # the ring of the second test: 4 ranks, 8 chunks
SHAPES = dict(b=2, n=3, c=5, d=4)  # the two-block test: c != d, so a missing [..., None] cannot broadcast

SHAPE_HINT = (
    "Return (O, L): O of shape (b, n, c, d) like O1, L of shape (b, n, c) like L1. A (b, n, c) factor "
    "scales O's rows only with a trailing axis: x[..., None]."
)
NO_RESCALING_HINT = (
    "Each partial output is an average over its own block, with weights that sum to 1 within that "
    "block; added as they are, every query's weights sum to 2. Each block must count by the share of "
    "the merged softmax denominator that its keys hold."
)
AVERAGE_HINT = (
    "An average gives both blocks the same weight whatever their scores; a block whose keys score "
    "higher holds more of the softmax's mass and must count more. What share of the merged "
    "denominator does each block hold, given L1, L2 and the merged L?"
)
MAX_HINT = (
    "max(L1, L2) is the log of the larger block's denominator alone (close only when one block "
    "dominates), while the merged L is the log of the denominator over all the keys of both blocks."
)
SUM_HINT = (
    "L1 + L2 is the log of the product of the two blocks' denominators, while the merged L is the log of "
    "the denominator over all the keys of both blocks."
)
OUTPUT_HINT = (
    "L is right but O is not: weight each partial output by the share of the merged softmax "
    "denominator that its block holds (the two shares sum to 1)."
)
LSE_HINT = "The merged L is the log of the softmax denominator over all the keys of both blocks."
RING_HINT = (
    "One merge of two blocks is right, but merged again and again in the ring's order (the result so far "
    "with block after block, diagonal blocks with masked keys among them) the result is off: does your "
    "function assume something of its inputs (which L is larger, their sign, blocks of equal size)?"
)


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q (b, n, c, d) over one block of keys and values k, v (b, n, c_k, d):
    the block's output O (b, n, c, d) and log-sum-exp L (b, n, c); ``causal`` masks key j > query i
    (a diagonal pair of chunks, c_k = c)."""
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (b, n, c, c_k)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (b, n, c)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full causal attention of (b, n, T, d) tensors, the reference: the output from PyTorch's
    ``scaled_dot_product_attention`` and the log-sum-exp of every query's visible scores (b, n, T)."""
    s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True), torch.logsumexp(s, dim=-1)


def ring_merged(
    merge: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int = CP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of (b, n, T, d) tensors as ``cp`` ring ranks compute it, in one process:
    the sequence in 2cp chunks, rank i holding chunks i and 2cp-1-i; at step t rank i holds rank
    (i - t)'s chunks, computes each pair (q chunk a, k chunk b) with b <= a (causal when b = a), and
    merges it into chunk a's result with ``merge``. Returns the output and log-sum-exp in sequence order."""
    qs, ks, vs = (x.chunk(2 * cp, dim=2) for x in (q, k, v))
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in range(cp):
        ring = Ring(None, ranks=tuple(range(cp)), index=i)
        for step in range(cp):
            theirs = ring.chunks((i - step) % cp)
            for a in ring.chunks():
                for b in theirs:
                    if b > a:
                        continue  # every key in the query's future: nothing to compute
                    o, lse = partial_attention(qs[a], ks[b], vs[b], causal=b == a)
                    out[a] = (o, lse) if a not in out else tuple(merge(*out[a], o, lse))
    o, lse = (torch.cat([out[a][x] for a in range(2 * cp)], dim=2) for x in (0, 1))
    return o, lse


def _random(shape: tuple[int, ...], generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(shape, generator=generator, dtype=torch.float64)


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and float((x - y).abs().max()) <= TOLERANCE


def _as_pair(got) -> tuple[torch.Tensor, torch.Tensor] | None:
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(x, torch.Tensor) for x in got):
        return got[0].to(torch.float64), got[1].to(torch.float64)
    return None


def _diagnose(got_o, got_l, o1, l1, o2, l2, o, lse) -> str:
    """The hint for a wrong two-block merge: the usual mistakes first, then which part is off."""
    right_l, right_o = _close(got_l, lse), _close(got_o, o)
    if not right_l and _close(got_l, torch.maximum(l1, l2)):
        return MAX_HINT
    if not right_l and _close(got_l, l1 + l2):
        return SUM_HINT
    if not right_o and _close(got_o, o1 + o2):
        return NO_RESCALING_HINT
    if not right_o and _close(got_o, (o1 + o2) / 2):
        return AVERAGE_HINT
    return OUTPUT_HINT if right_l else LSE_HINT


def judge(merge: Callable, seed: int = 0) -> tuple[object, bool, str]:
    """(what to show of the answer, right?, hint): ``FIXME`` while the function returns its stub's
    placeholders; otherwise a sentence with the errors against attention over all the keys."""
    g = torch.Generator().manual_seed(seed)
    b, n, c, d = SHAPES.values()
    q, k, v = _random((b, n, c, d), g, 1.5), _random((b, n, 11, d), g, 1.5), _random((b, n, 11, d), g)
    o1, l1 = partial_attention(q, k[:, :, :7], v[:, :, :7])  # two disjoint blocks of 7 and 4 keys
    o2, l2 = partial_attention(q, k[:, :, 7:], v[:, :, 7:])
    o, lse = partial_attention(q, k, v)
    try:
        got = merge(o1.clone(), l1.clone(), o2.clone(), l2.clone())
    except Exception as exc:  # the learner's code: any error is an answer to explain
        return f"your function raised {type(exc).__name__}: {exc}", False, SHAPE_HINT
    if untouched(got):
        return FIXME, False, ""
    pair = _as_pair(got)
    if pair is None or pair[0].shape != o.shape or pair[1].shape != lse.shape:
        shapes = [tuple(x.shape) for x in pair] if pair else type(got).__name__
        return f"it returned {shapes}, not (O {tuple(o.shape)}, L {tuple(lse.shape)})", False, SHAPE_HINT
    got_o, got_l = pair
    err_o, err_l = float((got_o - o).abs().max()), float((got_l - lse).abs().max())
    if max(err_o, err_l) > TOLERANCE:
        said = f"two blocks: O off by {err_o:.2g}, L off by {err_l:.2g}"
        return said, False, _diagnose(got_o, got_l, o1, l1, o2, l2, o, lse)
    # the ring: cp = 4, causal, every rank's chunks merged step by step in the engine's order
    T = 2 * CP * 3
    q, k, v = (_random((1, 2, T, d), g, 2.0 if x < 2 else 1.0) for x in range(3))
    ref_o, ref_l = causal_attention(q, k, v)
    try:
        ring_o, ring_l = (x.to(torch.float64) for x in ring_merged(merge, q, k, v))
    except Exception as exc:
        return f"along the ring your function raised {type(exc).__name__}: {exc}", False, RING_HINT
    ring_err_o, ring_err_l = float((ring_o - ref_o).abs().max()), float((ring_l - ref_l).abs().max())
    said = (
        f"O within {max(err_o, ring_err_o):.1e}, L within {max(err_l, ring_err_l):.1e} of attention over "
        f"all the keys (two blocks; causal, cp = {CP} in ring order), tolerance {TOLERANCE:.0e}"
    )
    return said, max(ring_err_o, ring_err_l) <= TOLERANCE, RING_HINT


def check_merge(merge: Callable, *, name: str = NAME, seed: int = 0) -> bool:
    """``check`` the learner's ``merge(O1, L1, O2, L2) -> (O, L)`` (:func:`judge`): prints ``[ok]``
    with the errors, ``[not yet]`` while it returns ``FIXME``, raises ExerciseError with a hint."""
    answer, right, hint = judge(merge, seed)
    return check(name, answer, ok=lambda _: right, hint=hint)


__all__ = ["causal_attention", "check_merge", "judge", "partial_attention", "ring_merged"]
