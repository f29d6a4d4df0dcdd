"""Profiler traces read with TensorBoard's PyTorch Profiler plugin's own parser (torch-tb-profiler).

The plugin reads CPU-only traces (gloo) and GPU traces alike, and what it computes here is what its
Overview, Operator and Memory views show. HolisticTraceAnalysis needs GPU kernels: on a CPU-only
trace its temporal breakdown fails, so on this course's local cluster the plugin is the reader.

A run is a folder ``<tensorboard-dir>/<profile-name>/`` of ``<worker>.<time>.pt.trace.json`` files,
one per traced rank (worker ``rank0``, ``rank2``, ...).

Step-time categories (the plugin's, exclusive, in its priority order) and the four groups the
notebook plots::

    computation    = Kernel + Memcpy + Memset + CPU Exec   (CPU Exec: operators on the CPU)
    communication  = Communication                         (nccl:* / gloo:* collectives)
    data loading   = DataLoader
    other          = Runtime + Other                       (launches, Python, waiting: the bubble)

The Overview gives communication priority over CPU operators: an all-reduce that runs under
backward (``--overlap-grad-reduce``) still counts as communication there. What the step waits
for is :meth:`Trace.communication_split`: the communication after the step's last backward
operator is *exposed*, the rest was *hidden* under backward (data parallelism, pp = 1).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

GROUPS = {
    "computation": ("Kernel", "Memcpy", "Memset", "CPU Exec"),
    "communication": ("Communication",),
    "data loading": ("DataLoader",),
    "other": ("Runtime", "Other"),
}
TRACE_RE = re.compile(r"^(.+?)\.(\d+)\.pt\.trace\.json(\.gz)?$")


def find_traces(run_dir: str | Path) -> dict[str, Path]:
    """``{worker: trace file}`` of one run folder (the newest trace per worker)."""
    run_dir = Path(run_dir)
    found: dict[str, Path] = {}
    for p in sorted(run_dir.glob("*.pt.trace.json*")) if run_dir.is_dir() else []:
        m = TRACE_RE.match(p.name)
        if m:
            found[m.group(1)] = p
    if not found:
        raise FileNotFoundError(
            f"no profiler trace in {run_dir}: run '{run_dir.name}' should have written it "
            f"(pretrain_gpt.py --profile-execution True --profile-name {run_dir.name} "
            f"--tensorboard-dir {run_dir.parent}); did that job complete?"
        )
    return dict(sorted(found.items(), key=lambda kv: _rank_key(kv[0])))


def _rank_key(worker: str) -> tuple[int, str]:
    m = re.search(r"(\d+)$", worker)
    return (int(m.group(1)) if m else -1, worker)


@dataclass
class Trace:
    """One worker's trace as the plugin parsed it (``profile`` is the plugin's ``RunProfile``)."""

    worker: str
    path: Path
    profile: object

    def breakdown_us(self) -> dict[str, float]:
        """The Overview's average step time per category, in microseconds (``Average Step Time`` too)."""
        perf = self.profile.overview["performance"][0]
        return {
            perf["name"]: float(perf["value"]),
            **{c["name"]: float(c["value"]) for c in perf["children"]},
        }

    def groups_ms(self) -> dict[str, float]:
        """Average step time in the four groups of the module docstring, in milliseconds."""
        b = self.breakdown_us()
        return {g: sum(b.get(c, 0.0) for c in cats) / 1000 for g, cats in GROUPS.items()}

    def step_ms(self) -> float:
        return self.breakdown_us()["Average Step Time"] / 1000

    def top_operators(self, n: int = 10, by: str = "host_self_duration") -> list[dict]:
        """The Operator view's rows (name, calls, host_self_duration, ... in us), largest first."""
        rows = self.profile.operation_table_by_name["data"]
        return sorted(rows, key=lambda r: r[by], reverse=True)[:n]

    def memory_curve(self) -> tuple[list[float], list[float]]:
        """(time ms since the profiler started, allocated MiB) on the default device, from the
        Memory view; empty without ``profile_memory``."""
        if self.profile.memory_snapshot is None:  # traced without profile_memory
            return [], []
        curve = self.profile.get_memory_curve(time_metric="ms", memory_metric="MB")
        dev = curve["metadata"]["default_device"]
        rows = curve["rows"].get(dev, []) if dev else []
        return [r[0] for r in rows], [r[1] for r in rows]

    def steps_ms(self) -> list[dict]:
        """Each traced step, in ms on the memory curve's time axis: start, end, first backward op."""
        events = json.loads(self.path.read_text())["traceEvents"]
        first_ts = self.profile.get_memory_curve()["metadata"]["first_ts"]
        spans = [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
        backward = sorted(
            e["ts"] for e in events if e.get("ph") == "X" and e["name"].startswith("autograd::engine")
        )
        out = []
        for s in sorted(spans, key=lambda e: e["ts"]):
            start, end = s["ts"], s["ts"] + s["dur"]
            bw = next((t for t in backward if start <= t <= end), None)
            out.append({"step": s["name"], "start": (start - first_ts) / 1000, "end": (end - first_ts) / 1000,
                        "backward": None if bw is None else (bw - first_ts) / 1000})  # fmt: skip
        return out


@dataclass
class StepSpans:
    """One traced step, in ms from its start: the backward's merged spans (the main thread's
    ``autograd::engine`` operators) and the collectives' (``gloo:*`` / ``nccl*``, any thread)."""

    name: str
    duration: float
    backward: list[tuple[float, float]]
    communication: list[tuple[float, float]]


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def step_spans(trace: Trace) -> list[StepSpans]:
    """Every traced step of ``trace`` as :class:`StepSpans`."""
    events = [e for e in json.loads(trace.path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    main_tid = steps[0]["tid"] if steps else None
    out = []
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]

        def within(e, t0=t0, t1=t1):
            return t0 <= e["ts"] <= t1

        bw = [
            e
            for e in events
            if e["tid"] == main_tid and e["name"].startswith("autograd::engine") and within(e)
        ]
        comm = [e for e in events if e["name"].startswith(("gloo:", "nccl")) and within(e)]
        spans = [
            _merge([((e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3) for e in group])
            for group in (bw, comm)
        ]
        out.append(StepSpans(s["name"], s["dur"] / 1e3, *spans))
    return out


def communication_split(trace: Trace) -> dict[str, float]:
    """Average ms per step of communication ``hidden`` before the end of the last backward
    operator and ``exposed`` after it, and the ``step``."""
    steps = step_spans(trace)
    hidden = exposed = 0.0
    for s in steps:
        end = s.backward[-1][1] if s.backward else 0.0
        hidden += sum(max(0.0, min(b, end) - a) for a, b in s.communication)
        exposed += sum(max(0.0, b - max(a, end)) for a, b in s.communication)
    n = max(1, len(steps))
    return {"hidden": hidden / n, "exposed": exposed / n, "step": sum(s.duration for s in steps) / n}


def load_trace(path: str | Path, worker: str | None = None) -> Trace:
    """Parse one trace file with the plugin (``RunProfileData.parse`` + ``RunGenerator``)."""
    from torch_tb_profiler.profiler.data import RunProfileData
    from torch_tb_profiler.profiler.run_generator import RunGenerator

    path = Path(path)
    worker = worker or TRACE_RE.match(path.name).group(1)
    with tempfile.TemporaryDirectory() as cache:
        data = RunProfileData.parse(worker, None, str(path), cache)
        profile = RunGenerator(worker, None, data).generate_run_profile()
    return Trace(worker, path, profile)


def load_run(run_dir: str | Path) -> dict[str, Trace]:
    """``{worker: Trace}`` of every traced rank of one run folder."""
    return {w: load_trace(p, w) for w, p in find_traces(run_dir).items()}
