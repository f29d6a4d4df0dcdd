"""Two random streams per rank, as Megatron-LM's ``tensor_parallel/random.py``, on any device.

For ``--seed s`` and this rank's pipeline stage ``pp_rank`` and tensor-parallel rank ``tp_rank``::

    default stream          s + 100 pp_rank                   the same on every tp (and dp) rank
    model-parallel stream   s + 100 pp_rank + 2718 + tp_rank  different on every tp rank

(Megatron's ``_set_random_seed`` and ``model_parallel_cuda_manual_seed``: "2718 is just for fun
and any POSITIVE value will work".) A dropout mask is drawn from the stream whose ranks hold the
same tensor: the default one for what the tp ranks hold alike (the replicated (b, T, H) hidden
states after the row-parallel ``g``, the embeddings' output without sequence parallelism), the
model-parallel one for what each tp rank holds alone (the attention probabilities of its own
heads; with sequence parallelism its own T / tp positions: Megatron runs the whole block, and the
embeddings' dropout after the scatter, inside :meth:`RNGStatesTracker.fork`). Drawing a rank's own
heads from the default stream would give every tp rank the same mask, which one process holding
all heads would never draw.

:meth:`RNGStatesTracker.fork` swaps the stream's saved state into the generators of the CPU and,
when CUDA is in use, of the current GPU (Megatron's ``CudaRNGStatesTracker`` swaps the GPU's
only), runs the block, saves the advanced state and puts the default one back. Recomputation
must replay both streams: :func:`checkpoint` is ``torch.utils.checkpoint`` (which restores the
default generators) that also restores the tracker's states to what they were at the forward
(Megatron's ``CheckpointFunction`` does the same). Checkpoints save :meth:`~RNGStatesTracker.get_states`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.utils.checkpoint

MODEL_PARALLEL = "model-parallel-rng"
#: Megatron's offset of the tensor-model-parallel seed.
OFFSET = 2718


def _devices() -> list[str]:
    """The generators a fork swaps: the CPU's, and the current GPU's once CUDA is in use."""
    return ["cpu", "cuda"] if torch.cuda.is_available() and torch.cuda.is_initialized() else ["cpu"]


def _get(device: str) -> torch.Tensor:
    return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()


def _set(device: str, state: torch.Tensor) -> None:
    if device == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state)


def _seeded(device: str, seed: int) -> torch.Tensor:
    """A generator state seeded with ``seed``, without touching the device's default generator."""
    gen = torch.Generator(device if device == "cpu" else torch.device("cuda", torch.cuda.current_device()))
    return gen.manual_seed(seed).get_state()


class RNGStatesTracker:
    """Named generator states beside the default ones (Megatron's ``CudaRNGStatesTracker``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seeds: dict[str, int] = {}
        self.states: dict[str, dict[str, torch.Tensor]] = {}  # name -> device -> state
        self.active: str | None = None  # the stream a fork has swapped in

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed`` (its per-device states are made when used)."""
        if name in self.seeds:
            raise ValueError(f"the random stream {name!r} already exists (seed {self.seeds[name]})")
        if seed in self.seeds.values():
            raise ValueError(f"seed {seed} is already used by another random stream")
        self.seeds[name], self.states[name] = seed, {}

    def get_states(self) -> dict:
        """Every stream's seed and states (copies), for a checkpoint or a recomputation; inside a
        fork, the forked stream's state is the one its draws have reached (in the generators)."""
        out = {}
        for name, seed in self.seeds.items():
            states = {d: s.clone() for d, s in self.states[name].items()}
            if name == self.active:
                states |= {d: _get(d) for d in _devices()}
            out[name] = {"seed": seed, "states": states}
        return out

    def set_states(self, states: dict) -> None:
        """Back to :meth:`get_states`' streams (inside a fork, the forked one into the generators)."""
        self.seeds = {name: s["seed"] for name, s in states.items()}
        self.states = {name: {d: t.clone() for d, t in s["states"].items()} for name, s in states.items()}
        if self.active is not None:
            for d, state in self.states.get(self.active, {}).items():
                if d in _devices():
                    _set(d, state)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        """Draw from stream ``name`` inside the block, from the default stream after it. A fork
        inside a fork of the same stream goes on drawing from it."""
        if self.active == name:
            yield
            return
        if name not in self.seeds:
            raise RuntimeError(
                f"the random stream {name!r} was never seeded: call "
                f"distlab.gpt.tensor_parallel.rng_tracker.model_parallel_manual_seed(seed, tp_rank) first (build_run does)"
            )
        devices = _devices()
        outer = {d: _get(d) for d in devices}
        saved = self.states[name]
        for d in devices:
            _set(d, saved[d] if d in saved else _seeded(d, self.seeds[name]))
        previous, self.active = self.active, name
        try:
            yield
        finally:
            for d in devices:
                saved[d] = _get(d)
                _set(d, outer[d])
            self.active = previous


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker (one per process, as Megatron's ``get_cuda_rng_tracker``)."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, tp_rank: int) -> None:
    """Seed the default stream with ``seed`` (already offset by the pipeline stage: ``s + 100
    pp_rank``) and the model-parallel stream with ``seed + 2718 + tp_rank``."""
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL, seed + OFFSET + tp_rank)


def fork_if(condition: bool) -> contextlib.AbstractContextManager:
    """:meth:`RNGStatesTracker.fork` of the model-parallel stream when ``condition``, else nothing
    (a block without dropout draws nothing, and leaves the streams alone)."""
    return _TRACKER.fork() if condition else contextlib.nullcontext()


def _replay_tracker() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn``: the forward runs as it is; the recomputation
    runs with the tracker's states of that forward, and leaves them as it found them."""
    at_forward = _TRACKER.get_states()

    @contextlib.contextmanager
    def replay() -> Iterator[None]:
        now = _TRACKER.get_states()
        _TRACKER.set_states(at_forward)
        try:
            yield
        finally:
            _TRACKER.set_states(now)

    return contextlib.nullcontext(), replay()


def checkpoint(fn: Callable, *args):
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` whose recomputation
    draws the same dropout masks from both streams as the forward did."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=_replay_tracker)
