"""The run's layout, validated once: how the world's ranks factor, and the batch arithmetic.

Ranks are laid out as Megatron-LM does (order ``tp-cp-dp-pp``, the first dimension fastest)::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    world size = tp x cp x dp x pp                 dp is what the other sizes leave

so the ``tp`` ranks of a tensor-parallel group are adjacent and share a node, where their
all-reduces are cheapest, and the ``cp`` ranks of a context-parallel ring come next (their
K/V blocks travel every layer). With world 8, tp 2, pp 2, dp 2 (cp 1)::

    tp groups : [0,1] [2,3] [4,5] [6,7]
    dp groups : [0,2] [1,3] [4,6] [5,7]
    pp groups : [0,4] [1,5] [2,6] [3,7]

and with world 8, tp 2, cp 2, dp 2: tp [0,1] [2,3] ..., cp [0,2] [1,3] [4,6] [5,7], dp [0,4]
[1,5] [2,6] [3,7]. Gradients are averaged over ``groups("dp", "cp")`` ([0,2,4,6] [1,3,5,7]):
cp ranks hold the same weights and see different tokens of the same samples.

A step consumes one global batch of ``B = b x dp x m`` samples (micro batch ``b``, ``m``
micro-batches per rank); with a batch-size ramp (``--rampup-batch-size``,
``--step-batch-size-schedule``) ``B`` grows with the samples consumed and every size it takes
must obey the same rule. e.g. ``16 = 2 x 4 x 2``.

:class:`Layout` is torch-free and checkable before any process group exists; every consumer
(process groups, data, schedule, memory estimate, DeepSpeed's config) reads it, none recomputes
it. A new dimension is one entry of :data:`ORDER` and :data:`SIZE_NAMES` and one size field:
the world-size rule, coordinates, groups and messages follow from them. Whether a model can be
cut along a layout (heads, layers, sequence, experts over the sizes) is ``model_layout.py``'s.

Experts (``ep``, Megatron's ``--expert-model-parallel-size``) are a second layout of the same
ranks, not a factor of the world: the ``dp`` ranks of one dense data-parallel group (dp x cp
where context parallelism exists: :data:`EXPERT_DATA_DIMS`) are cut into consecutive blocks of
``ep`` ranks, each block holding all the experts once (``E / ep`` each); ranks at the same place
of different blocks hold the same experts and form the expert-data-parallel group (``dp x cp / ep``
ranks). Expert gradients are *summed* over that group and divided by ``dp x cp``, not by its size
(Megatron's ``expert_gradient_scaling_factor`` = edp / (dp x cp) before an averaging all-reduce
over the edp group): each rank's expert gradient already sums the tokens its ep block's ranks
sent it, so the sum over the group covers every dp x cp rank's tokens once, and the division
gives the mean over the dense data-parallel ranks, as for every other weight. World 8, tp 2,
dp 4, ep 2::

    dp groups  : [0,2,4,6] [1,3,5,7]
    ep groups  : [0,2] [4,6] [1,3] [5,7]        tokens cross these with all-to-all
    edp groups : [0,4] [2,6] [1,5] [3,7]        expert gradients are summed over these, / (dp x cp)

Megatron-LM builds the experts' own rank grid from ``--expert-tensor-parallel-size`` (etp, default
tp; order tp-ep-dp-pp) and checks ``world size % (etp x ep x pp) == 0``
(``parallel_state.initialize_model_parallel``); with etp = tp, the one size this engine builds,
that is: ep divides dp x cp, and an ep group is consecutive ranks of a dp x cp group, as above.
The tokens of a layer's experts move among the ``tp x ep`` ranks of an ep group and their tp
groups (``tp_ep``; world 8, tp 2, dp 4, ep 2: [0,1,2,3] [4,5,6,7]).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

#: Dimensions from the fastest-varying rank coordinate to the slowest (Megatron's tp-cp-dp-pp).
ORDER = ("tp", "cp", "dp", "pp")
#: How messages name each size, and the flag that sets it (dp has none: it is what remains).
SIZE_NAMES = {
    "tp": ("tensor-model-parallel size", "--tensor-model-parallel-size"),
    "cp": ("context-parallel size", "--context-parallel-size"),
    "dp": ("data-parallel size", None),
    "pp": ("pipeline-model-parallel size", "--pipeline-model-parallel-size"),
    "ep": ("expert-model-parallel size", "--expert-model-parallel-size"),
}
#: The dimensions whose ranks hold the same dense weights and different tokens: ``ep`` splits their
#: product (Megatron, with etp = tp: ep divides dp x cp). A ``cp`` entry of :data:`ORDER` joins them by itself.
EXPERT_DATA_DIMS = tuple(d for d in ORDER if d in ("cp", "dp"))


def sequence_parallel_error(sequence_parallel: bool, tp: int) -> str | None:
    """Sequence parallelism splits the sequence over the tp ranks: it needs tp > 1 (the layout's
    own check, before any model)."""
    if sequence_parallel and tp == 1:
        return (
            "--sequence-parallel needs --tensor-model-parallel-size > 1, got 1: sequence parallelism "
            "splits the sequence over the tensor-parallel ranks; drop the flag or raise the size"
        )
    return None


@dataclass(frozen=True)
class Layout:
    """World size factored over :data:`ORDER`, and the global batch at every point of the run."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert-model-parallel size: ranks of a dp (x cp) group that share out the experts."""
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    """The final global batch B; None: ``b x dp`` (one micro-batch per step)."""
    batch_schedule: tuple[tuple[int, int], ...] = field(default=())
    """``(first sample, global batch)`` steps of a ramp, ending at B; empty: B throughout."""
    vp: int = 1
    """v, model chunks (virtual pipeline stages) per pipeline rank: interleaved 1F1B when > 1."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: outside the tp GEMMs each tp rank keeps T / tp of the sequence."""

    def __post_init__(self) -> None:
        given = {d: getattr(self, d) for d in ORDER if d != "dp"}
        if self.world_size < 1 or any(size < 1 for size in given.values()):
            sizes = ", ".join(f"{SIZE_NAMES[d][0]} {s}" for d, s in given.items())
            raise ValueError(f"parallel sizes must be >= 1: world size {self.world_size}, {sizes}")
        model_parallel = math.prod(given.values())
        if self.world_size % model_parallel:
            product = " x ".join(f"{SIZE_NAMES[d][0]} {s}" for d, s in given.items())
            raise ValueError(
                f"world size {self.world_size} is not divisible by {product} = {model_parallel}: "
                f"launch a multiple of {model_parallel} processes or change the sizes"
            )
        self._check_experts()
        if error := sequence_parallel_error(self.sequence_parallel, self.tp):
            raise ValueError(error)
        if self.global_batch_size is None:
            object.__setattr__(self, "global_batch_size", self.micro_batch_size * self.dp)
        self._check_batch()
        self._check_interleaving()

    # --- ranks ---------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.world_size // math.prod(getattr(self, d) for d in ORDER if d != "dp")

    def size(self, dim: str) -> int:
        return self.dp if dim == "dp" else getattr(self, dim)

    def _stride(self, dim: str) -> int:
        return math.prod(self.size(d) for d in ORDER[: ORDER.index(dim)])

    def coords(self, rank: int) -> tuple[int, ...]:
        """A global rank's coordinates, in :data:`ORDER` (``(tp_rank, cp_rank, dp_rank, pp_rank)``)."""
        return tuple((rank // self._stride(d)) % self.size(d) for d in ORDER)

    def coord(self, rank: int, dim: str) -> int:
        return self.coords(rank)[ORDER.index(dim)]

    def rank_of(self, *coords: int) -> int:
        """The global rank at ``coords`` (in :data:`ORDER`)."""
        return sum(c * self._stride(d) for c, d in zip(coords, ORDER, strict=True))

    def groups(self, *dims: str) -> list[list[int]]:
        """Every group of ``dims``: the ranks that differ only in those coordinates (one
        dimension, or several: ``groups("dp", "cp")``), each group in rank order."""
        others = [d for d in reversed(ORDER) if d not in dims]  # slowest first
        inner = [d for d in ORDER if d in dims]
        out = []
        for fixed in itertools.product(*(range(self.size(d)) for d in others)):
            at = dict(zip(others, fixed, strict=True))
            group = []
            for varying in itertools.product(*(range(self.size(d)) for d in inner)):
                at.update(zip(inner, varying, strict=True))
                group.append(self.rank_of(*(at[d] for d in ORDER)))
            out.append(sorted(group))
        return out

    # --- experts -------------------------------------------------------------------------
    @property
    def expert_data_size(self) -> int:
        """dp (x cp): the ranks ``ep`` splits (:data:`EXPERT_DATA_DIMS`)."""
        return math.prod(self.size(d) for d in EXPERT_DATA_DIMS)

    def ep_groups(self) -> list[list[int]]:
        """Consecutive blocks of ``ep`` ranks of each dp (x cp) group: each holds every expert once."""
        return [g[i : i + self.ep] for g in self.groups(*EXPERT_DATA_DIMS) for i in range(0, len(g), self.ep)]

    def edp_groups(self) -> list[list[int]]:
        """The ranks holding the same experts (same place in their ep block): ``dp x cp / ep`` each."""
        return [g[j :: self.ep] for g in self.groups(*EXPERT_DATA_DIMS) for j in range(self.ep)]

    def tp_ep_groups(self) -> list[list[int]]:
        """Each ep group with the tp ranks of its members (megatron-core's ``tp_ep`` group, etp = tp):
        the ``tp x ep`` ranks among which a token dispatcher moves tokens."""
        tp_of = {r: g for g in self.groups("tp") for r in g}
        found = {tuple(sorted(r for m in g for r in tp_of[m])): None for g in self.ep_groups()}
        return [list(g) for g in found]

    def _check_experts(self) -> None:
        name, flag = SIZE_NAMES["ep"]
        if self.ep < 1:
            raise ValueError(f"{flag} {self.ep} must be >= 1")
        if self.expert_data_size % self.ep:
            dims = [d for d in EXPERT_DATA_DIMS if d == "dp" or self.size(d) > 1]
            sizes = " x ".join(f"{SIZE_NAMES[d][0]} {self.size(d)}" for d in dims)
            total = f" = {self.expert_data_size}" if len(dims) > 1 else ""
            raise ValueError(
                f"{name} {self.ep} ({flag}) does not divide {sizes}{total} "
                f"(world size {self.world_size} over the model-parallel sizes): the experts are shared "
                f"out within the data-parallel ranks; choose {flag} among the divisors of "
                f"{self.expert_data_size} or launch more processes"
            )

    # --- batches -------------------------------------------------------------------------
    @property
    def num_micro_batches(self) -> int:
        """m at the final global batch size."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples."""
        size = self.global_batch_size
        for first, batch in self.batch_schedule:
            if consumed_samples >= first:
                size = batch
        return size

    def micro_batches_at(self, consumed_samples: int) -> int:
        return self.global_batch_at(consumed_samples) // (self.micro_batch_size * self.dp)

    def _check_interleaving(self) -> None:
        """Megatron's rules for v > 1: a pipeline to interleave, micro-batches in groups of pp."""
        if self.vp < 1:
            raise ValueError(f"the virtual pipeline size must be >= 1, got {self.vp}")
        if self.vp == 1:
            return
        if self.pp == 1:
            raise ValueError(
                f"{self.vp} virtual pipeline stages per rank need --pipeline-model-parallel-size > 1, got 1: "
                "drop --num-layers-per-virtual-pipeline-stage / --virtual-pipeline-model-parallel-size"
            )
        sizes = sorted({size for _, size in self.batch_schedule} | {self.global_batch_size})
        bad = [size // (self.micro_batch_size * self.dp) for size in sizes]
        bad = [m for m in bad if m % self.pp]
        if bad:
            raise ValueError(
                f"the interleaved schedule runs micro-batches in groups of --pipeline-model-parallel-size "
                f"{self.pp}: {bad[0]} micro-batches per step (--global-batch-size / (--micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {self.dp})) is not a multiple of {self.pp}: "
                f"use a global batch that is a multiple of {self.pp * self.micro_batch_size * self.dp}"
            )

    def _check_batch(self) -> None:
        b, gbs = self.micro_batch_size, self.global_batch_size
        if b < 1 or gbs < 1:
            raise ValueError(f"--micro-batch-size {b} and --global-batch-size {gbs} must both be >= 1")
        per_step = b * self.dp
        if gbs % per_step:
            raise ValueError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size {b} x "
                f"data-parallel size {self.dp} = {per_step}: use a multiple of {per_step}"
            )
        if not self.batch_schedule:
            return
        if self.batch_schedule[0][0] != 0 or self.batch_schedule[-1][1] != gbs:
            raise ValueError(
                f"the batch-size schedule {list(self.batch_schedule)} must start at sample 0 and end at "
                f"--global-batch-size {gbs}"
            )
        bad = [(first, size) for first, size in self.batch_schedule if size < 1 or size % per_step]
        if bad:
            raise ValueError(
                f"the batch-size ramp reaches global batch sizes {[s for _, s in bad]} (from samples "
                f"{[f for f, _ in bad]}) that are not multiples of --micro-batch-size {b} x data-parallel "
                f"size {self.dp} = {per_step}: every size of the ramp must be (choose a start and an "
                f"increment that are multiples of {per_step})"
            )


def describe_groups(layout: Layout, per_node: int) -> list[str]:
    """Every dimension's groups on nodes of ``per_node`` consecutive ranks, and whether each group
    stays inside one node (where its collectives use the fast links) or crosses nodes."""
    lines = []
    for dim in ORDER:
        if layout.size(dim) == 1:
            lines.append(f"{dim} (size 1): no group, no communication")
            continue
        groups = layout.groups(dim)
        inside = all(len({r // per_node for r in g}) == 1 for g in groups)
        where = "inside a node" if inside else "across nodes"
        shown = " ".join(str(g).replace(" ", "") for g in groups)
        lines.append(f"{dim} (size {layout.size(dim)}): {shown:<40} {where}")
    return lines


def rampup_schedule(start: int, increment: int, ramp_samples: int, global_batch_size: int) -> tuple:
    """``--rampup-batch-size start increment samples`` as ``(first sample, batch)`` steps.

    Megatron's ramp: the batch starts at ``start`` and grows by ``increment`` over
    ``n = (B - start) / increment`` equal intervals of ``samples / n`` samples, reaching ``B``
    when ``samples`` have been consumed. Step ``i`` begins at sample ``ceil(i samples / n)``.
    """
    flag = f"--rampup-batch-size {start} {increment} {ramp_samples}"
    if start < 1 or increment < 1 or ramp_samples < 0:
        raise ValueError(f"{flag}: start and increment must be >= 1 and samples >= 0")
    diff = global_batch_size - start
    if diff < 0 or diff % increment:
        raise ValueError(
            f"{flag}: --global-batch-size {global_batch_size} minus the start {start} = {diff} must be "
            f">= 0 and a multiple of the increment {increment}"
        )
    n = diff // increment
    if n == 0:
        return ((0, global_batch_size),)
    return tuple((-(-i * ramp_samples // n), start + i * increment) for i in range(n + 1))


def parse_step_schedule(text: str, seq_length: int) -> tuple:
    """``--step-batch-size-schedule "0:16 2.4B:320 ..."``: thresholds in tokens (K, M, B, T
    suffixes), as Megatron reads them, converted to samples of ``seq_length`` tokens."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}

    def number(part: str) -> int:
        part = part.strip().upper()
        mult = scale.get(part[-1:], 1)
        return int(float(part[:-1] if mult > 1 else part) * mult)

    steps = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        try:
            steps.append((number(threshold) // seq_length, number(batch)))
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(
                f'--step-batch-size-schedule "{text}": entry "{entry}" is not THRESHOLD:BATCH_SIZE '
                f'(tokens, e.g. "0:16 2.4B:320")'
            ) from None
    steps.sort()
    firsts = [first for first, _ in steps]
    if not steps or firsts[0] != 0 or len(set(firsts)) != len(firsts):
        raise ValueError(
            f'--step-batch-size-schedule "{text}": thresholds must start at 0 and differ by at least '
            f"one sample ({seq_length} tokens)"
        )
    return tuple(steps)
