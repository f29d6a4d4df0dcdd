"""This rank's place in the run's :class:`~distlab.gpt.layout.Layout`, and its process groups.

The layout (rank order, sizes, batch arithmetic) is validated once, in ``layout.py``;
:class:`ParallelState` adds this rank's coordinates and the groups it belongs to. Both are
passed explicitly.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, fields

import torch.distributed as dist

from distlab.gpt.layout import ORDER, Layout
from distlab.log_line import LogLine

#: Megatron's start-up line (:meth:`ParallelState.banner`), which the notebooks grep.
BANNER = LogLine(
    "using world size: {world_size:d}, data-parallel-size: {dp:d}, "
    "tensor-model-parallel size: {tp:d}, pipeline-model-parallel size: {pp:d}"
)


@dataclass
class ParallelState:
    """This rank's place in the layout, with the process groups it belongs to."""

    layout: Layout
    rank: int
    tp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    dp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    pp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    #: Expert parallelism: the ranks that share out the experts (all-to-all of tokens), and those
    #: holding the same experts (their gradients' all-reduce); built only when ep > 1.
    ep_group: dist.ProcessGroup | None = field(default=None, repr=False)
    edp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    #: The tp x ep ranks among which the MoE token dispatchers move tokens (the tp group when ep = 1).
    tp_ep_group: dist.ProcessGroup | None = field(default=None, repr=False)
    cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    #: The ranks holding the same weights (dp x cp), over which gradients and the loss are averaged.
    dp_cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    #: First and last pipeline stage of this rank's pipeline (they share the tied embedding).
    embedding_group: dist.ProcessGroup | None = field(default=None, repr=False)

    @classmethod
    def build(cls, layout: Layout, timeout_s: float | None = None) -> ParallelState:
        """Create every group on every rank (``new_group`` is collective), keep ours.

        ``timeout_s`` (``--distributed-timeout-minutes``): how long a collective of these groups
        waits for a missing rank. ``new_group`` does not inherit the default group's timeout: left
        out, it is PyTorch's default (30 min for gloo, 10 for NCCL)."""
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        if layout.world_size != dist.get_world_size():
            raise ValueError(
                f"the layout is for world size {layout.world_size}, the process group has "
                f"{dist.get_world_size()} ranks"
            )
        state = cls(layout=layout, rank=dist.get_rank())
        for dim in ORDER:
            for ranks in layout.groups(dim):
                group = dist.new_group(ranks, timeout=timeout, group_desc=dim)
                if state.rank in ranks:
                    setattr(state, f"{dim}_group", group)
        for ranks in layout.groups("dp", "cp"):
            group = dist.new_group(ranks, timeout=timeout, group_desc="dp_cp") if layout.cp > 1 else None
            if state.rank in ranks:
                state.dp_cp_group = group or state.dp_group
        for ranks in layout.groups("pp"):
            ends = sorted({ranks[0], ranks[-1]})
            group = dist.new_group(ends, timeout=timeout, group_desc="embedding")
            if state.rank in ends:
                state.embedding_group = group
        if layout.ep > 1:
            for name, groups in (("ep_group", layout.ep_groups()), ("edp_group", layout.edp_groups())):
                for ranks in groups:
                    group = dist.new_group(ranks, timeout=timeout, group_desc=name[:-6])
                    if state.rank in ranks:
                        setattr(state, name, group)
        state.tp_ep_group = state.ep_group if layout.tp == 1 else state.tp_group
        if layout.ep > 1 and layout.tp > 1:
            for ranks in layout.tp_ep_groups():
                group = dist.new_group(ranks, timeout=timeout)
                if state.rank in ranks:
                    state.tp_ep_group = group
        return state

    def groups(self) -> list[dist.ProcessGroup]:
        """The distinct process groups of this rank (each once, whatever roles it plays)."""
        found = [getattr(self, f.name) for f in fields(self) if f.name.endswith("_group")]
        return list({id(g): g for g in found if g is not None}.values())

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        """This rank's place in its ep group: it holds experts ``[ep_rank E / ep, (ep_rank + 1) E / ep)``."""
        return next(g.index(self.rank) for g in self.layout.ep_groups() if self.rank in g)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def vp(self) -> int:
        """v, model chunks this rank holds (interleaved 1F1B when > 1)."""
        return self.layout.vp

    @property
    def tp_rank(self) -> int:
        return self.layout.coord(self.rank, "tp")

    @property
    def dp_rank(self) -> int:
        return self.layout.coord(self.rank, "dp")

    @property
    def pp_rank(self) -> int:
        return self.layout.coord(self.rank, "pp")

    @property
    def cp_rank(self) -> int:
        return self.layout.coord(self.rank, "cp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of stage ``pp_rank`` in this rank's pipeline."""
        return self.layout.rank_of(self.tp_rank, self.cp_rank, self.dp_rank, pp_rank)

    def cp_ring(self) -> list[int]:
        """Global ranks of this rank's context-parallel group, in cp-rank order."""
        return [self.layout.rank_of(self.tp_rank, i, self.dp_rank, self.pp_rank) for i in range(self.cp)]

    def banner(self) -> str:
        """Megatron's start-up line, which the notebooks grep."""
        return BANNER.format(world_size=self.layout.world_size, dp=self.dp, tp=self.tp, pp=self.pp)
