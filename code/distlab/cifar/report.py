"""The scaling table from the jobs' logs: runtime for N epochs, speed-up and efficiency.

For a run on P processes taking T_P for the same N epochs as the one-process baseline T_1:

    speed-up    S_P = T_1 / T_P
    efficiency  E_P = S_P / P        (1.0 = perfect linear scaling)

T_P is read from the per-epoch lines that ``train_cifar.py`` prints on every rank,
``rank R/P host | epoch e/N | time t s | loss l | acc a% | v img/s``: an epoch lasts as long as
its slowest rank (they wait for each other at every all-reduce), so T_P = sum_e max_R t(R, e).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

EPOCH_LINE = re.compile(
    r"rank (?P<rank>\d+)/(?P<world>\d+) (?P<host>\S+) \| epoch (?P<epoch>\d+)/(?P<epochs>\d+) \| "
    r"time (?P<time>[\d.]+) s \| loss (?P<loss>[\d.]+) \| acc (?P<acc>[\d.]+)% \| (?P<ips>[\d.]+) img/s"
)


@dataclass
class RunLog:
    """What one job's log says about its training."""

    world: int = 0
    hosts: set[str] = field(default_factory=set)
    # (epoch, rank) -> {"time", "loss", "acc", "ips"}
    epochs: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)

    @property
    def num_epochs(self) -> int:
        return len({e for e, _ in self.epochs})

    @property
    def runtime(self) -> float:
        """Seconds of training: per epoch the slowest rank, summed over epochs."""
        per_epoch: dict[int, float] = {}
        for (e, _), v in self.epochs.items():
            per_epoch[e] = max(per_epoch.get(e, 0.0), v["time"])
        return sum(per_epoch.values())

    @property
    def final_acc(self) -> float:
        last = max(e for e, _ in self.epochs)
        return self.epochs[(last, 0)]["acc"]

    @property
    def images_per_s(self) -> float:
        """Global throughput of the last epoch: the sum over ranks."""
        last = max(e for e, _ in self.epochs)
        return sum(v["ips"] for (e, _), v in self.epochs.items() if e == last)


def parse_log(text: str) -> RunLog:
    """Collect every epoch line of a job's log; raise if there is none (the job did not train)."""
    run = RunLog()
    for m in EPOCH_LINE.finditer(text):
        run.world = int(m["world"])
        run.hosts.add(m["host"])
        run.epochs[(int(m["epoch"]), int(m["rank"]))] = {
            k: float(m[k]) for k in ("time", "loss", "acc", "ips")
        }
    if not run.epochs:
        raise ValueError(
            "no epoch lines ('rank R/P host | epoch e/N | time ...') in this log: "
            "did the job train? Look at its log for the error"
        )
    return run


def scaling_rows(runs: dict[str, RunLog | str | None], baseline: str) -> list[dict]:
    """One row per run: label, processes, nodes, runtime, speed-up, efficiency, accuracy.

    ``runs`` maps a label to a parsed log, or to a string saying why that row was skipped.
    """
    base = runs[baseline]
    if not isinstance(base, RunLog):
        raise ValueError(f"the baseline {baseline!r} has no log to compare against")
    rows = []
    for label, run in runs.items():
        if not isinstance(run, RunLog):
            rows.append({"run": label, "skipped": run or "not run"})
            continue
        if run.num_epochs != base.num_epochs:
            raise ValueError(
                f"{label!r} ran {run.num_epochs} epochs, the baseline {base.num_epochs}: "
                "compare runs of the same length"
            )
        speedup = base.runtime / run.runtime
        rows.append(
            {
                "run": label,
                "procs": run.world,
                "nodes": len(run.hosts),
                "runtime_s": run.runtime,
                "speedup": speedup,
                "efficiency": speedup / run.world * base.world,
                "img_per_s": run.images_per_s,
                "acc": run.final_acc,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table (what instructors put on a slide)."""
    head = f"{'run':<28}{'procs':>6}{'nodes':>6}{'time (s)':>10}{'speed-up':>10}{'effic.':>8}{'img/s':>9}{'acc %':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['run']:<28}  skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['run']:<28}{r['procs']:>6}{r['nodes']:>6}{r['runtime_s']:>10.2f}{r['speedup']:>10.2f}"
            f"{r['efficiency']:>8.0%}{r['img_per_s']:>9.0f}{r['acc']:>8.1f}"
        )
    return "\n".join(lines)


def plot_scaling(rows: list[dict], path: str | Path | None = None, title: str = ""):
    """Bars: runtime per run; line: scaling efficiency. Saved to ``path`` when given."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    done = [r for r in rows if "skipped" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['run']}\n({r['procs']} proc, {r['nodes']} node)" for r in done]
    ax.bar(labels, [r["runtime_s"] for r in done], color="tab:blue")
    ax.set_ylabel("training time (s)", color="tab:blue")
    eff = ax.twinx()
    eff.plot(labels, [100 * r["efficiency"] for r in done], "o-", color="tab:red")
    eff.set_ylabel("scaling efficiency (%)", color="tab:red")
    eff.set_ylim(0, 110)
    ax.set_title(title)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    return fig
