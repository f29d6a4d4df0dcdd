"""Context parallelism: the sequence split over ``cp`` ranks, attention by ring attention.

**Split.** A sample's T tokens are cut into ``2 cp`` chunks of ``c = T / (2 cp)``. Balanced
(Megatron's and the playbook's causal load balancing), rank i holds chunks i and 2cp-1-i;
unbalanced (contiguous), chunks 2i and 2i+1. Every layer except attention works on the rank's
T / cp tokens alone (positions and labels are cut the same way, :func:`split_sequence`).

**Ring attention.** Rank i keeps its queries Q_i and passes K/V blocks around the ring
i -> i+1: at step s it holds the block of rank ``j = i - s (mod cp)``, computes the attention
of Q_i to it while the block moves on (one ``batch_isend_irecv`` per step, a send to i+1 and a
receive from i-1: NCCL-safe), and merges the partial results by their log-sum-exp
(online softmax). For one query row with partial outputs o_1, o_2 over two sets of keys::

    lse = log(exp(lse_1) + exp(lse_2))        o = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2

Causal masking works per pair of chunks (q chunk a, k chunk b): all keys visible if b < a,
the causal triangle if b == a, nothing if b > a (skipped). Balanced, every rank computes the
same work at every step (two pairs; at step 0 one pair and two half diagonals); contiguous, rank
cp-1 computes at every step while rank 0 waits after step 0: chunk j attends to j + 1/2 pairs, so
rank i does (2i + 1/2) + (2i + 3/2) = 4i + 2 pairs, and rank cp-1 does 4cp - 2, (2cp - 1) times
rank 0's 2 (:func:`pair_work`).

**Backward** (:class:`RingAttention`, a ``torch.autograd.Function``): the probabilities are
*recomputed* per block from Q, K and the saved log-sum-exp (as FlashAttention does), never
stored. K/V go round the ring again, and with them an fp32 accumulator of dK/dV: every rank
adds its queries' contribution to the block it holds and passes the accumulator on with it; after
``cp`` hops the accumulator is back at the block's owner, complete. Per layer and micro-batch each
rank sends, in blocks of (b, n/tp, T/cp, d): forward ``cp - 1`` K/V messages of two blocks (K and
V), ``2 (cp - 1)`` blocks; backward ``cp - 1`` K/V messages again (``2 (cp - 1)`` blocks) and
``cp`` dK/dV messages of two fp32 blocks each (``2 cp`` blocks, in fp32).
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.gpt.model_layout import context_chunks_error
from distlab.gpt.parallel_state import ParallelState
from distlab.log_line import LogLine

#: The start-up line of a context-parallel run (``context_parallel.describe``), after the banner.
CONTEXT_PARALLEL = LogLine(
    "> context parallelism: {cp:d} ranks, sequence {seq_length:d} in {chunks:d} chunks of {chunk:d} tokens "
    "({how}), {per_rank:d} tokens per rank, ring attention"
)

_KV, _DKV = 0, 1  # message tags: a K/V block, a dK/dV accumulator


@dataclass(frozen=True)
class Ring:
    """One context-parallel group as a ring: its process group, global ranks in cp order, ours."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    index: int
    balanced: bool = True
    timeout_s: float = 300.0

    @property
    def size(self) -> int:
        return len(self.ranks)

    def chunks(self, index: int | None = None) -> tuple[int, int]:
        """The two chunk numbers (of 2 cp) held by cp rank ``index`` (ours by default)."""
        return chunk_ids(self.size, self.index if index is None else index, self.balanced)


def ring_of(state: ParallelState | None) -> Ring | None:
    """This rank's context-parallel ring (balanced split), None without context parallelism."""
    if state is None or state.cp == 1:
        return None
    return Ring(state.cp_group, tuple(state.cp_ring()), state.cp_rank)


def chunk_ids(cp: int, cp_rank: int, balanced: bool = True) -> tuple[int, int]:
    """Rank i's chunks: (i, 2cp-1-i) balanced, (2i, 2i+1) contiguous."""
    return (cp_rank, 2 * cp - 1 - cp_rank) if balanced else (2 * cp_rank, 2 * cp_rank + 1)


def split_sequence(x: torch.Tensor, ring: Ring, dim: int = 1) -> torch.Tensor:
    """This rank's T / cp tokens of ``x`` (..., T, ...) along ``dim``: its two chunks, concatenated."""
    T = x.shape[dim]
    if error := context_chunks_error(T, ring.size):  # model_layout's rule, on the tokens given
        raise ValueError(error)
    parts = x.chunk(2 * ring.size, dim=dim)
    return torch.cat([parts[c] for c in ring.chunks()], dim=dim)


def positions(local_length: int, ring: Ring, device: torch.device) -> torch.Tensor:
    """Global position ids (T/cp,) of this rank's tokens, for the learned position embedding."""
    full = torch.arange(local_length * ring.size, device=device)
    return split_sequence(full, ring, dim=0)


def pair_work(cp: int, balanced: bool = True) -> list[list[float]]:
    """Attention work of every rank (rows) at every ring step (columns), in chunk pairs of c x c
    scores (a diagonal pair counts 1/2): what :class:`RingAttention` computes and skips."""
    work = []
    for i in range(cp):
        mine = chunk_ids(cp, i, balanced)
        row = []
        for s in range(cp):
            theirs = chunk_ids(cp, (i - s) % cp, balanced)
            row.append(sum(1.0 if b < a else 0.5 if b == a else 0.0 for a in mine for b in theirs))
        work.append(row)
    return work


def _exchange(ring: Ring, tensor: torch.Tensor, tag: int) -> tuple[list, torch.Tensor]:
    """Post, as ONE batch, the send of ``tensor`` to the next rank and the receive of the same
    shape from the previous one; return the works and the buffer being received into."""
    received = torch.empty_like(tensor)
    nxt, prev = ring.ranks[(ring.index + 1) % ring.size], ring.ranks[(ring.index - 1) % ring.size]
    ops = [
        dist.P2POp(dist.isend, tensor.contiguous(), nxt, group=ring.group, tag=tag),
        dist.P2POp(dist.irecv, received, prev, group=ring.group, tag=tag),
    ]
    return dist.batch_isend_irecv(ops), received


def _wait(ring: Ring, works: list) -> None:
    for work in works:
        work.wait(timeout=datetime.timedelta(seconds=ring.timeout_s))


def _pairs(ring: Ring, source: int):
    """(q chunk slot, k chunk slot, causal) for every pair of chunks that is not fully masked."""
    for x, a in enumerate(ring.chunks()):
        for y, b in enumerate(ring.chunks(source)):
            if b <= a:
                yield x, y, b == a


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """Q K^T / sqrt(d), the future masked with -inf on a diagonal pair: (b, n, c, c), fp32."""
    s = torch.matmul(q, k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    """Causal softmax(Q K^T / sqrt(d)) V over the whole sequence, for this rank's queries.

    q, k, v: (b, n, T/cp, d), this rank's two chunks concatenated -> (b, n, T/cp, d).
    ``timeline``, if a list, receives ``(step, start, end)`` of each step's forward compute.
    """

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, timeline: list | None = None):
        qs = q.chunk(2, dim=2)  # 2 x (b, n, c, d)
        out = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
        lse = [torch.full(x.shape[:-1], float("-inf"), device=q.device) for x in qs]  # (b, n, c)
        kv = torch.stack([k, v])  # (2, b, n, T/cp, d): one message per step
        for step in range(ring.size):
            pending = _exchange(ring, kv, _KV) if step < ring.size - 1 else None
            start = time.perf_counter()
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for x, y, causal in _pairs(ring, (ring.index - step) % ring.size):
                s = _scores(qs[x], ks[y], causal)
                block_lse = torch.logsumexp(s, dim=-1)  # (b, n, c)
                block_out = torch.matmul(torch.exp(s - block_lse[..., None]).to(v.dtype), vs[y]).float()
                new = torch.logaddexp(lse[x], block_lse)
                out[x] = (
                    torch.exp(lse[x] - new)[..., None] * out[x]
                    + torch.exp(block_lse - new)[..., None] * block_out
                )
                lse[x] = new
            if timeline is not None:
                timeline.append((step, start, time.perf_counter()))
            if pending is not None:
                _wait(ring, pending[0])
                kv = pending[1]
        # (b, n, T/cp, d), stored as (b, T/cp, n, d): the projection's input is a view, not a copy
        o = torch.cat(out, dim=2).to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, dim=2))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        scale = 1.0 / math.sqrt(q.shape[-1])
        qs, dos, lses = q.chunk(2, dim=2), do.chunk(2, dim=2), lse.chunk(2, dim=2)
        delta = (do.float() * o.float()).sum(-1).chunk(2, dim=2)  # rowsum(dO * O): (b, n, c) each
        dq = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # of the block we hold
        for step in range(ring.size):
            pending = _exchange(ring, kv, _KV) if step < ring.size - 1 else None
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            dks, dvs = list(dkv[0].chunk(2, dim=2)), list(dkv[1].chunk(2, dim=2))  # views of dkv
            for x, y, causal in _pairs(ring, (ring.index - step) % ring.size):
                p = torch.exp(_scores(qs[x], ks[y], causal) - lses[x][..., None])  # recomputed (b, n, c, c)
                dvs[y] += torch.matmul(p.transpose(-2, -1), dos[x].float())
                dp = torch.matmul(dos[x].float(), vs[y].float().transpose(-2, -1))
                ds = p * (dp - delta[x][..., None]) * scale
                dq[x] += torch.matmul(ds, ks[y].float())
                dks[y] += torch.matmul(ds.transpose(-2, -1), qs[x].float())
            works, dkv_next = _exchange(ring, dkv, _DKV)  # the accumulator follows its block
            _wait(ring, works)
            dkv = dkv_next
            if pending is not None:
                _wait(ring, pending[0])
                kv = pending[1]
        return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Causal attention of this rank's queries to the whole sequence: (b, n, T/cp, d) each."""
    return RingAttention.apply(q, k, v, ring)


def describe(seq_length: int, ring: Ring) -> str:
    """The start-up line of a context-parallel run (:data:`CONTEXT_PARALLEL`)."""
    how = "load-balanced: rank i holds chunks i and 2cp-1-i" if ring.balanced else "contiguous"
    return CONTEXT_PARALLEL.format(
        cp=ring.size,
        seq_length=seq_length,
        chunks=2 * ring.size,
        chunk=seq_length // (2 * ring.size),
        how=how,
        per_rank=seq_length // ring.size,
    )
