"""Data x tensor x pipeline layout of the ranks, validated, and its process groups.

Ranks are laid out as Megatron-LM does (order ``tp-dp-pp``, tensor-parallel fastest)::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so the ``tp`` ranks of a tensor-parallel group are adjacent and share a node, where their
all-reduces are cheapest. With world 8, tp 2, pp 2, dp 2::

    tp groups : [0,1] [2,3] [4,5] [6,7]
    dp groups : [0,2] [1,3] [4,6] [5,7]
    pp groups : [0,4] [1,5] [2,6] [3,7]

``ParallelDims`` is the arithmetic alone (checkable before any process group exists);
``ParallelState`` adds this rank's coordinates and the groups. Both are passed explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    """World size factored as ``tp x pp x dp``; ``dp`` is what remains."""

    world_size: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world_size < 1:
            raise ValueError(
                f"parallel sizes must be >= 1: world size {self.world_size}, "
                f"tensor-model-parallel size {self.tp}, pipeline-model-parallel size {self.pp}"
            )
        if self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by tensor-model-parallel size "
                f"{self.tp} x pipeline-model-parallel size {self.pp} = {self.tp * self.pp}: "
                f"launch a multiple of {self.tp * self.pp} processes or change the sizes"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.dp * self.tp + dp_rank * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)
        ]

    def dp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)
        ]

    def pp_groups(self) -> list[list[int]]:
        return [
            [self.rank_of(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)
        ]

    def validate_model(self, *, num_layers: int, num_attention_heads: int, hidden_size: int) -> None:
        """Heads and hidden size must split over ``tp``, layers over ``pp``."""
        errors = []
        if num_attention_heads % self.tp:
            errors.append(
                f"--num-attention-heads {num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {self.tp}"
            )
        if hidden_size % self.tp:
            errors.append(
                f"--hidden-size {hidden_size} is not divisible by --tensor-model-parallel-size {self.tp}"
            )
        if num_layers % self.pp:
            errors.append(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {self.pp}"
            )
        if errors:
            raise ValueError("; ".join(errors) + ": change the model size or the parallel layout")

    def validate_batch(self, *, global_batch_size: int, micro_batch_size: int) -> int:
        """Return gradient-accumulation steps: ``global = micro x dp x accumulation``."""
        if micro_batch_size < 1 or global_batch_size < 1:
            raise ValueError(
                f"--micro-batch-size {micro_batch_size} and --global-batch-size "
                f"{global_batch_size} must both be >= 1"
            )
        per_step = micro_batch_size * self.dp
        if global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
                f"{micro_batch_size} x data-parallel size {self.dp} = {per_step}: use a multiple of {per_step}"
            )
        return global_batch_size // per_step


@dataclass
class ParallelState:
    """This rank's place in the layout, with the process groups it belongs to."""

    dims: ParallelDims
    rank: int
    tp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    dp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    pp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    #: First and last pipeline stage of this rank's pipeline (they share the tied embedding).
    embedding_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @classmethod
    def build(cls, *, tp: int = 1, pp: int = 1) -> ParallelState:
        """Create every group on every rank (``new_group`` is collective), keep ours."""
        world, rank = dist.get_world_size(), dist.get_rank()
        dims = ParallelDims(world, tp, pp)
        state = cls(dims=dims, rank=rank)
        for attr, groups in (
            ("tp_group", dims.tp_groups()),
            ("dp_group", dims.dp_groups()),
            ("pp_group", dims.pp_groups()),
        ):
            for ranks in groups:
                group = dist.new_group(ranks)
                if rank in ranks:
                    setattr(state, attr, group)
        for ranks in dims.pp_groups():
            ends = sorted({ranks[0], ranks[-1]})
            group = dist.new_group(ends)
            if rank in ends:
                state.embedding_group = group
        return state

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def tp_rank(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.dims.coords(self.rank)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of stage ``pp_rank`` in this rank's pipeline."""
        return self.dims.rank_of(self.tp_rank, self.dp_rank, pp_rank)

    def banner(self) -> str:
        """Megatron's start-up line, which the notebooks grep."""
        return (
            f"using world size: {self.dims.world_size}, data-parallel-size: {self.dp}, "
            f"tensor-model-parallel size: {self.tp}, pipeline-model-parallel size: {self.pp}"
        )
