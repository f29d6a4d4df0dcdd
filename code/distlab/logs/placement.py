"""Which global rank sits on which node, and which TP / PP / DP groups it belongs to.

Hosts come from the job itself, in one of two ways:

* one task per rank (``srun python pretrain_gpt.py``): ``srun --label hostname`` prints
  ``<task>: <host>``, and Slurm's task id is the rank that launch uses (``SLURM_PROCID``);
* torchrun: its rendezvous, not Slurm, numbers the ranks (node rank x nproc-per-node + local
  rank, the node ranks in the order the agents joined), so each rank prints its own host:
  ``torchrun ... -m distlab.logs.placement pretrain_gpt.py ARGS`` prints
  ``> rank <r> on <host> (torchrun node rank <n>, local rank <l>)`` and runs the script. The
  engine's own ``> rank <r> on <host>: <NCCL_*/GLOO_* settings>`` lines, printed when such
  variables are set, are read the same way.

Coordinates come from the run's memory report (``[rank r tp t pp p dp d]``); the groups are
those of the engine's own layout (``Layout``, Megatron's tp-dp-pp order).
"""

from __future__ import annotations

import os
import re
import runpy
import socket
import sys

from distlab.gpt.layout import Layout
from distlab.logs.megatron import memory_rows, parse_banner, split_runs

LABELLED_HOST_RE = re.compile(r"^\s*(\d+): (\S+)\s*$")


#: Not anchored at the line's start: another rank's print may write its text and its newline in two
#: calls, and a line written between them starts after that text.
RANK_HOST_RE = re.compile(r"> rank (\d+) on ([\w.-]+)(?=: | \(torchrun|$)", re.M)


def rank_host_line(env: dict[str, str] | None = None) -> str:
    """This process's ``> rank <r> on <host> (torchrun node rank <n>, local rank <l>)`` line,
    from the variables torchrun gives its workers (``RANK``, ``GROUP_RANK``, ``LOCAL_RANK``)."""
    env = os.environ if env is None else env
    return (
        f"> rank {env['RANK']} on {socket.gethostname()} "
        f"(torchrun node rank {env.get('GROUP_RANK', '?')}, local rank {env.get('LOCAL_RANK', '?')})"
    )


def rank_hosts(text: str) -> dict[int, str]:
    """rank -> host, from ``srun --label hostname`` lines (``0: node1``: task id = rank) and from
    ``> rank <r> on <host>`` lines (printed by the rank itself; these win)."""
    hosts = {int(m[1]): m[2] for m in map(LABELLED_HOST_RE.match, text.splitlines()) if m}
    return hosts | {int(m[1]): m[2] for m in RANK_HOST_RE.finditer(text)}


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


def main(argv: list[str] | None = None) -> None:
    """``python -m distlab.logs.placement SCRIPT [ARGS]``: print :func:`rank_host_line`, then run
    SCRIPT with ARGS as ``python SCRIPT ARGS`` would (``torchrun ... -m distlab.logs.placement``)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit("usage: python -m distlab.logs.placement SCRIPT [ARGS...] (under torchrun)")
    sys.stdout.flush()
    os.write(
        sys.stdout.fileno(), f"{rank_host_line()}\n".encode()
    )  # one write: the ranks' lines do not interleave
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as python SCRIPT does
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
