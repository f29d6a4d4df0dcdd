"""The step-time model (``distlab/gpt/planning/step_model.py``) against published and measured runs.

Published runs (instant; ``planning/published.py``): predicted against published throughput or
MFU, with the error and where the predicted step goes::

    python benchmarks/bench_step_model.py

Measured here (``--local``): the local hardware is measured first (``planning/local_cluster.py``:
one rank's GEMM rate, a sweep of gloo's collectives from 1 KiB to 16 MiB, an fp32 exp's latency
and bandwidth, a copy's bandwidth), then the fraction of that GEMM rate the model's step reaches, from the first layout
(the one calibration, measured first and last, the faster kept: a CPU step of a small model is far
from its GEMM peak), then the other 21 of
22 layouts of a small GPT over 2 spawned gloo ranks (dp, tp, tp + SP, pp, interleaved pp, cp, ep
with the alltoall and the allgather dispatcher; 1 to 8 micro-batches) each train ``--iters``
iterations on mock data; the median iteration after the first is compared with the prediction.
Prints the table (with where the predicted step goes) and the median absolute error over the 21
(the issue's target: at most 15% over at least 20). About 5 minutes on the quiet 2-core machine;
timings of a shared machine are noisy (quote ``uptime`` with the figures)::

    python benchmarks/bench_step_model.py --local [--iters 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from distlab.gpt.planning.local_cluster import calibrate, measure_local, predict_run
from distlab.gpt.planning.published import table
from distlab.gpt.planning.step_model import StepPrediction
from distlab.local_runs import spawn_pretrain

MODEL = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 "
    "--lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 4096 --split 99,1,0 --eval-iters 0 "
    "--distributed-backend gloo --log-interval 100"
)
DIMS = {
    "dp 2": "",
    "tp 2": "--tensor-model-parallel-size 2",
    "tp 2 + SP": "--tensor-model-parallel-size 2 --sequence-parallel",
    "pp 2": "--pipeline-model-parallel-size 2",
    "pp 2 v 2": "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2",
    "cp 2": "--context-parallel-size 2",
}
EXPERTS = "--num-experts 4 --expert-model-parallel-size 2"


def local_layouts() -> list[tuple[str, str]]:
    """22 (name, flags): six layouts x 1, 2 and 4 micro-batches of 2 samples (interleaved: 2, 4, 8,
    multiples of pp), and ep 2 x 1 and 2 micro-batches with each token dispatcher."""
    out = []
    for name, flags in DIMS.items():
        for m in (2, 4, 8) if "v 2" in name else (1, 2, 4):
            dp = 2 if name == "dp 2" else 1
            batch = 2 * m * dp
            out.append((f"{name}, m {m}", f"{flags} --micro-batch-size 2 --global-batch-size {batch}"))
    for dispatcher in ("alltoall", "allgather"):
        for m in (1, 2):
            flags = f"{EXPERTS} --moe-token-dispatcher-type {dispatcher}"
            out.append(
                (f"ep 2 {dispatcher}, m {m}", f"{flags} --micro-batch-size 2 --global-batch-size {4 * m}")
            )
    return out


def measured_step(argv: list[str], world: int) -> float:
    """Median seconds of the iterations after the first of ``pretrain(argv)`` on ``world`` local ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        result = spawn_pretrain(argv, world, tmp)
    return statistics.median(result.last["iter_ms"][1:]) / 1000


def where(p: StepPrediction) -> str:
    """The predicted step's exposed communication, bubble and last stage's extra, in ms."""
    parts = [f"{k} {1000 * v:.1f}" for k, v in p.exposed.items() if v > 0]
    parts += [f"{k} {1000 * v:.1f}" for k, v in (("bubble", p.bubble), ("last stage", p.last_stage)) if v > 0]
    return ", ".join(parts) or "none"


def run_local(iters: int) -> None:
    """Measure the hardware; calibrate the fraction of its GEMM rate the model's step reaches on
    the first layout (dp 2, one micro-batch: the step is its compute and one all-reduce), measured
    before and after the others; predict and measure the other 21."""
    print("> load average at the start: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg()))
    hw = measure_local(ranks_per_node=2, threads_per_rank=1)
    el, mem, link = hw.elementwise, hw.memory, hw.intra_node
    swept = ", ".join(
        f"{op} {1e3 * pts[0][1]:.2f}-{1e3 * pts[-1][1]:.1f}" for op, pts in link.measured.items()
    )
    print(f"> {hw.name}: {hw.peak_flops / 1e9:.1f} GFLOP/s per rank; gloo, ms from 1 KiB to 16 MiB: {swept}; "
          f"fp32 exp {el.latency * 1e6:.1f} us + bytes / {el.bandwidth / 1e9:.2f} GB/s, copy {mem.bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    layouts = local_layouts()
    name, flags = layouts[0]
    calibration = f"{MODEL} {flags} --train-iters {2 * iters}".split()
    first = measured_step(calibration, 2)
    measured = {n: measured_step(f"{MODEL} {f} --train-iters {iters}".split(), 2) for n, f in layouts[1:]}
    # measured again at the end, the faster of the two sets every prediction: on a shared machine a
    # step is only ever slowed, and one slow calibration (404 ms once, 226 to 249 ms in five other
    # runs on the quiet machine) moved every prediction by the same factor (median error 33%)
    last = measured_step(calibration, 2)
    hw = calibrate(hw, calibration, min(first, last))
    print(f"> calibration, {name}: measured {1000 * first:.1f} ms at the start, {1000 * last:.1f} ms at the end, so the "
          f"step reaches {100 * hw.achieved_fraction:.0f}% of the GEMM rate (used below)")  # fmt: skip
    print(
        f"{'layout':26s} {'predicted ms':>13s} {'measured ms':>12s} {'error':>7s}  predicted ms: compute, unfused, optimizer; exposed"
    )
    errors = []
    for name, flags in layouts[1:]:
        p = predict_run(f"{MODEL} {flags} --train-iters {iters}".split(), hw)
        errors.append(abs(p.step - measured[name]) / measured[name])
        print(f"{name:26s} {1000 * p.step:13.1f} {1000 * measured[name]:12.1f} {100 * (p.step - measured[name]) / measured[name]:+6.1f}%  "
              f"{1000 * p.compute:.1f}, {1000 * p.unfused:.1f}, {1000 * p.optimizer:.1f}; {where(p)}", flush=True)  # fmt: skip
    print("> load average at the end: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg()))
    print(
        f"> median absolute error over {len(errors)} layouts: {100 * statistics.median(errors):.1f}% (target 15%)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local", action="store_true", help="also measure 22 layouts on 2 local gloo ranks")
    parser.add_argument(
        "--iters", type=int, default=6, help="iterations per local layout (the first is not timed)"
    )
    opts = parser.parse_args(argv)
    if opts.local:
        run_local(opts.iters)
    print("\n".join(table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
