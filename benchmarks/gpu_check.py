"""GPU check (never in CI): pretrain_gpt.py against a plain training loop on one CUDA GPU.

For each shape, in one run on the same GPU, four trainings of the same model (same layers, widths,
sequence, micro batch and 4096-token offline vocabulary, bf16, no dropout):

* the engine: ``code/pretrain_gpt.py`` under ``torchrun --standalone --nproc-per-node=1`` (nccl),
  eager and with ``--torch-compile`` (each block compiled);
* a plain single-file loop (``benchmarks/plain_gpt.py``: nanoGPT-style, SDPA, bf16 autocast,
  fused AdamW, pinned non-blocking batches), eager and with ``torch.compile``.

Shapes: ``gpt2-small`` (12 layers, H 768, 12 heads, s 1024, micro batch 16) and ``1.2b`` (24 layers,
H 2048, 16 heads, s 2048, micro batch 8). Printed per shape and variant: the median step time of
the steady iterations (the engine's ``elapsed time per iteration`` lines from iteration 15 on; the
loop's CUDA-event times of its second half), engine / plain, MFU (the engine's log line: model
FLOPs per second over the device's dense bf16 peak; the loop does the same FLOPs per step, so its
MFU is the engine's scaled by the step times), and from a profiler trace of two steps (taken with
the same profiler options for both): the GPU's busy share of a step (kernels, copies and sets, as
a union of intervals, over the steps' span) and host-device synchronisations per step
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``; ``.item()`` calls
appear as ``aten::_local_scalar_dense``). Targets (issue: the engine as fast as a plain loop):
engine / plain at most 1.03, MFU at least 55% at 1.2b compiled.

    python benchmarks/gpu_check.py                              # both shapes, ~6 minutes on an H100
    python benchmarks/gpu_check.py --shapes gpt2-small --iters 20
    tensorboard --logdir runs/gpu_check                         # the engine's traces

Without CUDA it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from distlab import REPO_ROOT
from distlab.local_runs import prepare_data

#        name          layers hidden heads  seq micro
SHAPES = {"gpt2-small": (12, 768, 12, 1024, 16), "1.2b": (24, 2048, 16, 2048, 8)}
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
FIELD = r"{}: ([\d.]+)"


def engine_argv(shape: str, iters: int, data: list[str], out: Path, compiled: bool) -> list[str]:
    L, h, n, s, m = SHAPES[shape]
    return ["--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads", str(n),
            "--seq-length", str(s), "--max-position-embeddings", str(s), "--micro-batch-size", str(m),
            "--global-batch-size", str(m), "--train-iters", str(iters), "--bf16",
            "--lr", "1e-4", "--lr-decay-style", "constant", "--split", "99,1,0",
            "--eval-interval", str(10 * iters), "--eval-iters", "0", "--log-interval", "5",
            "--distributed-backend", "nccl", "--tensorboard-dir", str(out),
            "--profile-execution", "True", "--profile-step-start", "5", "--profile-step-end", "7",
            "--profile-name", "trace", *(["--torch-compile"] if compiled else []), *data]  # fmt: skip


def run(cmd: list[str], log: Path) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"gpu_check: {' '.join(cmd[:4])} ... failed ({log}):\n{done.stderr[-3000:]}")
    return done.stdout


def engine(shape: str, iters: int, data: list[str], out: Path, compiled: bool) -> dict:
    """Step time (median over the log lines from iteration 15 on), MFU, memory line, trace."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(REPO_ROOT / "code" / "pretrain_gpt.py"), *engine_argv(shape, iters, data, out, compiled)]  # fmt: skip
    log = run(cmd, out / "pretrain.log")
    lines = [x for x in log.splitlines() if x.startswith(" iteration")]
    steady = [x for x in lines if int(re.search(r"iteration\s+(\d+)", x).group(1)) >= 15]
    if not steady:
        raise SystemExit(f"gpu_check: no iteration line from 15 on in {out / 'pretrain.log'}: raise --iters")

    def median(name: str) -> float | None:
        found = [float(m.group(1)) for x in steady if (m := re.search(FIELD.format(name), x))]
        return statistics.median(found) if found else None

    traces = sorted((out / "trace").glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    return {
        "ms": median(r"elapsed time per iteration \(ms\)"),
        "mfu": median("MFU"),
        "memory": next((x.strip() for x in log.splitlines() if "memory (MiB)" in x), ""),
        "trace": traces[-1] if traces else None,
    }


def plain(shape: str, iters: int, token_file: str, out: Path, compiled: bool) -> dict:
    L, h, n, s, m = SHAPES[shape]
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "plain_gpt.py"), "--data", token_file,
           "--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads", str(n),
           "--seq-length", str(s), "--micro-batch-size", str(m), "--vocab-size", "4096",
           "--iters", str(iters), "--profile-dir", str(out), *(["--compile"] if compiled else [])]  # fmt: skip
    result = json.loads(run(cmd, out / "plain.log").strip().splitlines()[-1])
    return {"ms": statistics.median(result["ms"][iters // 2 :]), "trace": Path(result["trace"]),
            "peak_gib": result.get("peak_gib")}  # fmt: skip


def trace_stats(path: Path | None) -> tuple[float, float, float]:
    """(GPU busy share of the traced steps, synchronisations per step, .item() calls per step)."""
    if path is None:
        return float("nan"), float("nan"), float("nan")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep")]
    if not steps:
        raise SystemExit(f"gpu_check: no ProfilerStep in {path}")
    t0, t1 = min(a for a, _ in steps), max(b for _, b in steps)
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] >= t0)  # fmt: skip
    end = max([t1] + [b for _, b in gpu])
    busy, cur_a, cur_b = 0.0, None, None
    for a, b in gpu:  # union of the GPU's intervals
        if cur_b is None or a > cur_b:
            busy += 0 if cur_b is None else cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += 0 if cur_b is None else cur_b - cur_a
    inside = [e for e in events if t0 <= e["ts"] <= t1]
    syncs = sum(e["name"] in SYNCS for e in inside)
    items = sum(e["name"] == "aten::_local_scalar_dense" for e in inside)
    return busy / (end - t0), syncs / len(steps), items / len(steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="gpt2-small,1.2b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--out", default=str(REPO_ROOT / "runs" / "gpu_check"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU is visible here (torch.cuda.is_available() is False), so there "
            "is nothing to measure. Run it on a GPU node, e.g. `srun --gpus=1 --time=00:30:00 "
            "python benchmarks/gpu_check.py`.",
            file=sys.stderr,
        )
        return 2
    shapes = [x for x in args.shapes.split(",") if x]
    unknown = [x for x in shapes if x not in SHAPES]
    if unknown:
        p.error(f"--shapes {args.shapes}: unknown {unknown}; choose from {list(SHAPES)}")
    files = prepare_data(REPO_ROOT / "data" / "gpt" / "bpe4096", 4096)
    out = Path(args.out)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"{'shape':10s} {'variant':9s} {'engine ms':>9s} {'plain ms':>9s} {'ratio':>6s} {'MFU eng':>7s} "
          f"{'MFU pl':>7s} {'busy eng':>8s} {'busy pl':>8s} {'sync/step e/p':>13s} {'item/step e/p':>13s}")  # fmt: skip
    memory = []
    for shape in shapes:
        for compiled in [False] if args.no_compile else [False, True]:
            variant = "compiled" if compiled else "eager"
            e = engine(shape, args.iters, files.argv(), out / shape / f"engine-{variant}", compiled)
            q = plain(shape, args.iters, files.data_path + ".bin", out / shape / f"plain-{variant}", compiled)
            (be, se, ie), (bp, sp, ip) = trace_stats(e["trace"]), trace_stats(q["trace"])
            mfu_p = e["mfu"] * e["ms"] / q["ms"] if e["mfu"] is not None else float("nan")
            mfu_e = e["mfu"] if e["mfu"] is not None else float("nan")
            print(f"{shape:10s} {variant:9s} {e['ms']:9.1f} {q['ms']:9.1f} {e['ms'] / q['ms']:6.3f} "
                  f"{mfu_e:6.1f}% {mfu_p:6.1f}% {100 * be:7.1f}% {100 * bp:7.1f}% "
                  f"{se:6.1f}/{sp:<6.1f} {ie:6.1f}/{ip:<6.1f}", flush=True)  # fmt: skip
            memory.append(f"{shape} {variant}: engine {e['memory']}; plain peak {q['peak_gib']:.2f} GiB")
    print("\n".join(memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
