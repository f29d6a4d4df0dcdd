"""The scaling table from the jobs' logs: runtime for N epochs, speed-up and efficiency.

For a run on P processes taking T_P for the same N epochs as the one-process baseline T_1:

    speed-up    S_P = T_1 / T_P
    efficiency  E_P = S_P / P        (1.0 = perfect linear scaling)

T_P is read from the per-epoch lines that ``train_cifar.py`` prints on every rank,
``rank R/P host | epoch e/N | time t s | loss l | acc a% | v img/s``: an epoch lasts as long as
its slowest rank (they wait for each other at every all-reduce), so T_P = sum_e max_R t(R, e).
The table's img/s is the total throughput, sum_R v(R, e) of the last epoch (one rank's is about
1/P of it).

:func:`check_resume` is the check of notebook 03's exercise (a run stopped after epoch 1 and
resumed in a second job equals the uninterrupted run), from the three jobs' logs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from distlab.checks import check

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
    head = (
        f"{'run':<28}{'procs':>6}{'nodes':>6}{'time (s)':>10}{'speed-up':>10}{'effic.':>8}"
        f"{'img/s, all ranks':>18}{'acc %':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['run']:<28}  skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['run']:<28}{r['procs']:>6}{r['nodes']:>6}{r['runtime_s']:>10.2f}{r['speedup']:>10.2f}"
            f"{r['efficiency']:>8.0%}{r['img_per_s']:>18.0f}{r['acc']:>8.1f}"
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


def epoch_lines(text: str, epochs: range | list[int]) -> dict[tuple[int, int], tuple[float, float]]:
    """{(epoch, rank): (loss, acc)} of the given epochs in a log (those it printed)."""
    run = parse_log(text)
    return {(e, r): (v["loss"], v["acc"]) for (e, r), v in sorted(run.epochs.items()) if e in epochs}


def _epochs(text: str) -> list[int]:
    """The epochs a log printed lines of ([] for none: the job did not train)."""
    try:
        return sorted({e for e, _ in parse_log(text).epochs})
    except ValueError:
        return []


def check_resume(part1: str, part2: str, uninterrupted: str, *, exact: bool, rtol: float = 0.05) -> bool:
    """``check`` notebook 03's exercise from the logs of part 1, part 2 and the uninterrupted run.

    Part 1 printed epoch 1 only (``--stop-after 1``), equal to the uninterrupted run's epoch 1;
    part 2 printed epochs 2..N and none before (it went on from part 1's checkpoint: a part 2
    without ``--resume`` trains epochs 1..N again from the same seed, and its epoch N equals the
    uninterrupted one too); every (epoch, rank) of part 2 has the uninterrupted run's loss and
    accuracy: equal as printed with ``exact`` (CPU kernels and gloo are deterministic), else within
    ``rtol`` (cuDNN may pick non-deterministic kernels on GPUs; 5% as notebook 03's launcher
    comparison allows there, not measured on the local cluster, which has no GPU). Raises
    ExerciseError naming what differs; True when all holds.
    """
    last = max(_epochs(uninterrupted))
    reference = epoch_lines(uninterrupted, range(1, last + 1))
    check(
        "part 1: the epochs in its log", _epochs(part1), expected=[1], reveal=True,
        hint="part 1 stops after its first epoch, as a time limit would (--stop-after 1); "
        "no epoch at all: read its log for the error",
    )  # fmt: skip
    first = epoch_lines(part1, [1])
    check(
        "part 1: epoch 1 against the uninterrupted run's, rank by rank", first,
        ok=lambda got: _same(got, {k: v for k, v in reference.items() if k[0] == 1}, exact, rtol),
        hint="part 1 needs the launch line of 3c: 2 nodes, $CIFAR_ARGS, --batch-size $CIFAR_BATCH",
    )  # fmt: skip
    check(
        "part 2: the epochs in its log", _epochs(part2), expected=list(range(2, last + 1)), reveal=True,
        hint="part 2 goes on from part 1's checkpoint, at epoch 2: a line of epoch 1 means it "
        "trained from scratch (add --resume, with part 1's --checkpoint jobs/resume.pt)",
    )  # fmt: skip
    later = {k: v for k, v in reference.items() if k[0] >= 2}
    check(
        "part 2: its epochs against the uninterrupted run's, rank by rank",
        epoch_lines(part2, range(2, last + 1)),
        ok=lambda got: _same(got, later, exact, rtol),
        hint=f"the uninterrupted run's epoch 2 was {({k: v for k, v in later.items() if k[0] == 2})} "
        "as {(epoch, rank): (loss, acc %)}; part 2 needs 3c's launch line and part 1's checkpoint",
    )  # fmt: skip
    return True


def _same(got: dict, want: dict, exact: bool, rtol: float) -> bool:
    if got.keys() != want.keys():
        return False
    if exact:
        return got == want
    return all(abs(g - w) <= rtol * abs(w) for k in want for g, w in zip(got[k], want[k], strict=True))
