"""Interleaved 1F1B: each of the ``p`` ranks holds ``v`` model chunks (virtual pipeline stages).

The L layers form ``p v`` virtual stages of ``L / (p v)`` layers; chunk ``c`` of pipeline rank
``r`` is virtual stage ``s = c p + r``, so a micro-batch goes round the ring of ranks ``v``
times (rank ``p-1``'s chunk ``c`` feeds rank 0's chunk ``c+1``). Each F or B is ``1/v`` of a
plain stage's, and the pipeline fills and drains ``v`` times faster::

    bubble / ideal time = (p - 1) / (v m)      against (p - 1) / m for 1F1B
    bubble / step       = (p - 1) / (v m + p - 1)

for the price of more point-to-point messages: ``2 m (v p - 1)`` per step instead of ``2 m (p - 1)``.

Order (Megatron-LM's ``forward_backward_pipelining_with_interleaving``): the micro-batches go
in groups of ``p``; the ``v m`` forwards of a rank run group by group, chunk 0 then chunk 1 ...
over the group's ``p`` micro-batches (``m`` must be a multiple of ``p``: ``layout.py`` checks
it, and that ``p v`` divides L); the backwards in the same order with the chunks reversed. Rank ``r`` runs ``W = min(2 (p - r - 1) + (v - 1) p, v m)``
warm-up forwards, then one forward / one backward, then the cool-down backwards. With p = 2,
v = 2, m = 4 (F/B chunk.micro-batch)::

    rank 0: F0.0 F0.1 F1.0 F1.1 | F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 | B1.2 B1.3 B0.2 B0.3
    rank 1: F0.0 F0.1 | F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 ...

Communication (:func:`p2p_plan`): between two steps, ONE batch of point-to-point operations
(``pp_communications.exchange``): the outputs of the step just run, and the inputs of the next
one. Operations to or from one peer are posted activations first, gradients second, on both
sides: with p = 2 a rank's previous and next rank are the same peer, and NCCL matches a pair's
operations in the order they are posted (Megatron-LM refuses p = 2 with
``--no-overlap-p2p-communication``, whose single batch posts them in different orders). ``tests/test_gpt_interleaved.py`` simulates every
rank's batches for deadlocks and mismatched messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from distlab.gpt.pipeline_parallel.p2p_communication import exchange

Action = tuple[str, int, int]  # ("F" | "B", chunk, micro-batch)
Message = tuple[str, int, int]  # ("x" | "dy", receiving virtual stage, micro-batch)

#: step(x, i, c): forward of micro-batch i through chunk c (x None on virtual stage 0).
ChunkStep = Callable[[torch.Tensor | None, int, int], torch.Tensor]


def interleaved_order(p: int, v: int, m: int, rank: int, forward_only: bool = False) -> list[list[Action]]:
    """Rank ``rank``'s steps: ``[F]`` (warm-up), ``[F, B]`` (steady), ``[B]`` (cool-down)."""
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches in groups of p = {p}, got m = {m}")
    table = [(c, i) for g in range(0, m, p) for c in range(v) for i in range(g, g + p)]
    forwards = [("F", c, i) for c, i in table]
    if forward_only:
        return [[f] for f in forwards]
    backwards = [("B", v - 1 - c, i) for c, i in table]
    total = v * m
    w = min(2 * (p - rank - 1) + (v - 1) * p, total)
    steady = [[forwards[w + j], backwards[j]] for j in range(total - w)]
    return [[f] for f in forwards[:w]] + steady + [[b] for b in backwards[total - w :]]


def sent_by(p: int, v: int, rank: int, action: Action) -> tuple[Message, int] | None:
    """What an action sends, and to which rank: y to the next virtual stage, dx to the previous."""
    kind, c, i = action
    s = c * p + rank
    if kind == "F" and s < p * v - 1:
        return ("x", s + 1, i), (rank + 1) % p
    if kind == "B" and s > 0:
        return ("dy", s - 1, i), (rank - 1) % p
    return None


def _input(p: int, v: int, rank: int, action: Action) -> tuple[Message, int] | None:
    """What an action needs, and from which rank (None on virtual stage 0 / the last one)."""
    kind, c, i = action
    s = c * p + rank
    if kind == "F" and s > 0:
        return ("x", s, i), (rank - 1) % p
    if kind == "B" and s < p * v - 1:
        return ("dy", s, i), (rank + 1) % p
    return None


@dataclass(frozen=True)
class Round:
    """One batch of point-to-point operations: (message, peer rank) sent, then received."""

    sends: list[tuple[Message, int]]
    recvs: list[tuple[Message, int]]


def p2p_plan(p: int, v: int, m: int, rank: int, forward_only: bool = False) -> list[Round]:
    """Round k precedes step k: step k-1's outputs out, step k's inputs in (len(steps) + 1 rounds)."""
    steps = interleaved_order(p, v, m, rank, forward_only)
    first = {"x": 0, "dy": 1}  # activations before gradients, on every side of every pair

    def ops(actions: list[Action], fn) -> list[tuple[Message, int]]:
        found = [op for op in (fn(p, v, rank, a) for a in actions) if op is not None]
        return sorted(found, key=lambda op: first[op[0][0]])

    return [
        Round(ops(steps[k - 1] if k else [], sent_by), ops(steps[k] if k < len(steps) else [], _input))
        for k in range(len(steps) + 1)
    ]


def run_interleaved(chunks: list, m: int, forward_only: bool = False) -> None:
    """Megatron's interleaved order over this rank's v chunks, one batch of p2p between steps.

    ``chunks[c]``: chunk c's runner (``pipeline_parallel._Stage``): ``forward(x, i)`` -> y,
    ``backward(x, y, dy, i)`` -> dx, and the rank's ``state`` and ``spec``.
    """
    state, spec, v = chunks[0].state, chunks[0].spec, len(chunks)
    p, rank = state.pp, state.pp_rank
    steps = interleaved_order(p, v, m, rank, forward_only)
    inbox: dict = {}  # message -> received (b, T, H) tensor
    outbox: dict = {}  # message -> (b, T, H) output waiting for its round
    saved: dict = {}  # (chunk, micro-batch) -> (x, y) until its backward
    for k, rnd in enumerate(p2p_plan(p, v, m, rank, forward_only)):
        if rnd.sends or rnd.recvs:
            sends = [(outbox.pop(msg), peer) for msg, peer in rnd.sends]
            got = exchange(state, spec, sends, [peer for _, peer in rnd.recvs])
            inbox.update(zip([msg for msg, _ in rnd.recvs], got, strict=True))
        for action in steps[k] if k < len(steps) else []:
            kind, c, i = action
            s = c * p + rank  # virtual stage
            if kind == "F":
                x = inbox.pop(("x", s, i), None)
                out = y = chunks[c].forward(x, i)
                if not forward_only:
                    saved[c, i] = (x, y)
            else:
                out = chunks[c].backward(*saved.pop((c, i)), inbox.pop(("dy", s, i), None), i)
            to = sent_by(p, v, rank, action)
            if to is not None:
                outbox[to[0]] = out
