"""Which global rank sits on which node, and which TP / PP / DP groups it belongs to.

Hosts come from the job itself: ``srun --label hostname`` with one task per rank prints
``<task>: <host>`` and Slurm's task id is the rank the one-task-per-rank launch uses
(``SLURM_PROCID``). Coordinates come from the run's memory report (``[rank r tp t pp p dp d]``);
the groups are those of the engine's own layout (``Layout``, Megatron's tp-dp-pp order).
"""

from __future__ import annotations

import re

from distlab.gpt.layout import Layout
from distlab.logs.megatron import memory_rows, parse_banner, split_runs

LABELLED_HOST_RE = re.compile(r"^\s*(\d+): (\S+)\s*$")


def rank_hosts(text: str) -> dict[int, str]:
    """task id -> host from ``srun --label hostname`` lines (``0: node1``)."""
    return {int(m[1]): m[2] for m in map(LABELLED_HOST_RE.match, text.splitlines()) if m}


def placement_rows(text: str) -> list[dict]:
    """One row per rank: host, (tp, pp, dp) coordinates, and its three groups (first run of the log)."""
    first = next(iter(split_runs(text)), text)
    banner, hosts = parse_banner(first), rank_hosts(text)
    layout = Layout(banner.world_size, banner.tp, banner.pp)
    group_of = {
        kind: {r: g for g in groups for r in g}
        for kind, groups in ((k, layout.groups(k)) for k in ("tp", "pp", "dp"))
    }
    rows = []
    for m in memory_rows(first):
        r = m["rank"]
        rows.append(
            {"rank": r, "host": hosts.get(r, "?"), "tp_rank": m["tp"], "pp_rank": m["pp"], "dp_rank": m["dp"]}
            | {f"{k}_group": group_of[k][r] for k in ("tp", "pp", "dp")}
        )
    return rows


def format_placement(rows: list[dict]) -> str:
    head = f"{'rank':>4}  {'node':<8}{'tp':>3}{'pp':>3}{'dp':>3}   {'TP group':<10}{'PP group':<10}{'DP group':<10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['rank']:>4}  {r['host']:<8}{r['tp_rank']:>3}{r['pp_rank']:>3}{r['dp_rank']:>3}   "
            f"{str(r['tp_group']):<10}{str(r['pp_group']):<10}{str(r['dp_group']):<10}"
        )
    return "\n".join(lines)
