"""Context parallelism measured on local gloo ranks (notebook 09): activation bytes per rank and
the ring's compute timeline, next to what ``memory_estimate`` and ``context_parallel`` predict.

:func:`measure` spawns 4 ranks once and, for every cp in ``cps`` (rings of ranks ``0..cp-1``):

* **activations**: the bytes autograd keeps for backward while the GPT's L blocks run forward on
  this rank's (b, s / cp, H) tokens (``torch.autograd.graph.saved_tensors_hooks``; each storage
  counted once, parameters left out), for every sequence length: the blocks' activation memory
  per rank, against ``memory_estimate.stage_layers_bytes``;
* **timeline** (cp = 4): the start and end of every ring step's attention compute on every rank,
  for the balanced and the contiguous split, from one synchronised start.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distlab.distributed import init_distributed, shutdown
from distlab.gpt.context_parallel.ring_attention import Ring, RingAttention, pair_work, split_sequence
from distlab.gpt.layout import Layout
from distlab.gpt.memory.memory_estimate import MemorySetup, stage_layers_bytes
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_ranks import free_port, torchrun_env

MiB = 2**20
WORLD = 4
TIMELINE_HEAD_DIM = 64  # long enough blocks that compute, not messages, fills the timeline


def saved_bytes(fn, *args, exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn(*args)`` runs (``exclude``:
    storage pointers not to count, e.g. the parameters')."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(seen.values())


def _blocks_bytes(cfg: GPTConfig, state: ParallelState, seq: int, b: int) -> int:
    model = GPTModel(cfg, state)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    h = torch.randn(b, seq // state.cp, cfg.hidden_size, requires_grad=True)  # (b, s/cp, H)

    def blocks(x: torch.Tensor) -> torch.Tensor:
        for block in model.layers.values():
            x = block(x)
        return x

    return saved_bytes(blocks, h, exclude=params)


def _timeline(ring: Ring, seq: int, heads: int, d: int) -> list:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (split_sequence(torch.randn(1, heads, seq, d, generator=gen), ring, dim=2) for _ in range(3))
    spans: list = []
    dist.barrier()
    t0 = time.perf_counter()
    with torch.no_grad():
        RingAttention.apply(q, k, v, ring, spans)
    return [(step, start - t0, end - t0) for step, start, end in spans]


def _rank(
    rank: int, seq_lengths: list[int], cps: list[int], cfg: dict, timeline_seq: int, port: int, out: str
) -> None:
    os.environ.update(torchrun_env(rank, WORLD, port))
    torch.set_num_threads(1)
    init_distributed("gloo")
    try:
        model_cfg, b = GPTConfig(**cfg), 1
        result: dict = {"activations": {}, "timeline": {}}
        groups = {cp: dist.new_group(list(range(cp))) for cp in cps}  # collective: every rank
        for cp in cps:
            state = ParallelState(Layout(cp, cp=cp), rank=rank, cp_group=groups[cp], dp_cp_group=groups[cp])
            if rank < cp:
                result["activations"][cp] = [_blocks_bytes(model_cfg, state, s, b) for s in seq_lengths]
            dist.barrier()
        for balanced in (True, False):
            ring = Ring(None, tuple(range(WORLD)), rank, balanced=balanced)
            spans = _timeline(ring, timeline_seq, model_cfg.num_attention_heads, TIMELINE_HEAD_DIM)
            gathered: list = [None] * WORLD
            dist.all_gather_object(gathered, spans)
            result["timeline"]["balanced" if balanced else "contiguous"] = gathered
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        shutdown()


def measure(
    seq_lengths: list[int], cps: tuple[int, ...] = (1, 2, 4), timeline_seq: int = 4096, **model
) -> dict:
    """Activation bytes of rank 0 per (cp, sequence length), measured and predicted, and the ring
    timelines (cp = 4, ``timeline_seq`` tokens, heads of 64) of both splits. ``model``: GPTConfig
    fields (num_layers, hidden_size, num_attention_heads, vocab_size)."""
    cfg = dict(max_position_embeddings=max(seq_lengths), **model)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cp.json")
        mp.spawn(
            _rank,
            args=(list(seq_lengths), list(cps), cfg, timeline_seq, free_port(), out),
            nprocs=WORLD,
            join=True,
        )
        result = json.loads(Path(out).read_text())
    result["activations"] = {int(cp): v for cp, v in result["activations"].items()}
    result["predicted"] = {cp: [stage_layers_bytes(_setup(cfg, s, cp)) for s in seq_lengths] for cp in cps}
    result["seq_lengths"] = list(seq_lengths)
    return result


def _setup(cfg: dict, seq: int, cp: int) -> MemorySetup:
    return MemorySetup.from_layout(  # cp ranks, one sample each
        Layout(cp, cp=cp),
        num_layers=cfg["num_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        seq_length=seq,
        vocab_size=cfg["vocab_size"],
    )


def plot_activations(result: dict, ax=None):
    """Measured (dots) and predicted (lines) activation MiB per rank against the sequence length."""
    ax = ax or plt.gca()
    seqs = result["seq_lengths"]
    for i, cp in enumerate(sorted(result["predicted"])):
        ax.plot(
            seqs, [x / MiB for x in result["predicted"][cp]], "-", color=f"C{i}", label=f"cp = {cp} predicted"
        )
        ax.plot(
            seqs,
            [x / MiB for x in result["activations"][cp]],
            "o",
            color=f"C{i}",
            label=f"cp = {cp} measured",
        )
    ax.set_xlabel("sequence length s (tokens)")
    ax.set_ylabel("activation MiB per rank (the L blocks)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def plot_timelines(result: dict) -> plt.Figure:
    """Each rank's ring steps (bars: attention compute of one step) for both splits, side by side,
    with the chunk pairs each rank computes (``context_parallel.pair_work``) in the titles."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 2.8), sharex=True)
    for ax, (name, ranks) in zip(axes, result["timeline"].items(), strict=True):
        work = [sum(row) for row in pair_work(len(ranks), name == "balanced")]
        for r, spans in enumerate(ranks):
            ax.broken_barh(
                [(a, b - a) for _, a, b in spans], (r - 0.4, 0.8), color=[f"C{s}" for s, _, _ in spans]
            )
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
        ax.invert_yaxis()
        ax.set_xlabel("seconds from the common start (colour: ring step)")
        ax.set_title(f"{name} split: chunk pairs per rank {work}", fontsize=9)
    fig.tight_layout()
    return fig


def idle_fraction(spans_per_rank: list) -> float:
    """Share of the ranks' time until the slowest rank's last step ends that they spend not computing."""
    end = max(b for spans in spans_per_rank for _, _, b in spans)
    busy = sum(b - a for spans in spans_per_rank for _, a, b in spans)
    return 1.0 - busy / (end * len(spans_per_rank))
