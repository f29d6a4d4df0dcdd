"""FSDP2 against DeepSpeed ZeRO-3 at the same layout, and torch.compile against eager.

Every run trains the same GPT on the same batches on ``--world`` local gloo ranks, all of them
data parallel, through ``pretrain_gpt.py``: ``--use-torch-fsdp2`` (PyTorch's ``fully_shard``),
``--deepspeed --zero-stage 3`` (DeepSpeed's partitioned parameters: the same ZeRO-3 arithmetic,
notebook 07) and ``--use-torch-fsdp2 --torch-compile`` (the blocks compiled by inductor). The
time of a run is the median of its iterations after ``--warmup`` (Megatron's "elapsed time per
iteration", log interval 1); the runs go in turn, ``--rounds`` times, so that a change of the
machine's load reaches every variant alike, and each variant's figure is its best round. Prints
the ratios FSDP2 / ZeRO-3 (target: at most 1.1) and eager / compiled; writes the logs and a JSON
summary under ``--out``.

    python benchmarks/bench_fsdp2_vs_zero3.py --out runs/bench_fsdp2        # 2 ranks, GPT 4 x 256
    python benchmarks/bench_fsdp2_vs_zero3.py --world 4 --hidden-size 512 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from distlab.gpt.native.torch_compile import COMPILE
from distlab.local_runs import prepare_data, spawn_pretrain
from distlab.logs.megatron import iterations

VARIANTS = {
    "fsdp2": ["--use-torch-fsdp2"],
    "zero3": ["--deepspeed", "--zero-stage", "3"],
    "fsdp2_compiled": ["--use-torch-fsdp2", "--torch-compile"],
}


def model_argv(a: argparse.Namespace) -> list[str]:
    """A small GPT (Megatron's spellings), one micro-batch per rank and step."""
    return (
        f"--num-layers {a.num_layers} --hidden-size {a.hidden_size} --num-attention-heads 4 "
        f"--seq-length {a.seq_length} --micro-batch-size {a.micro_batch_size} "
        f"--global-batch-size {a.micro_batch_size * a.world} --train-iters {a.warmup + a.iters} "
        f"--lr 1e-3 --log-interval 1 --eval-iters 0 --split 949,50,1 --distributed-backend gloo"
    ).split()


def run_once(a: argparse.Namespace, data: list[str], name: str, folder: Path) -> dict:
    log = spawn_pretrain([*model_argv(a), *data, *VARIANTS[name]], a.world, folder).log
    rows = iterations(log)
    timed = [r["ms"] for r in rows[a.warmup :]]
    out = {"ms": statistics.median(timed), "first_ms": rows[0]["ms"], "losses": [r["loss"] for r in rows]}
    compiled = COMPILE.parse(log)
    if compiled:
        out["compile_line"] = compiled[0]
    return out


def bench(a: argparse.Namespace) -> dict:
    data = prepare_data(Path(a.out) / "data", vocab_size=512, max_files=40).argv()
    rounds: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for r in range(a.rounds):
        for name in VARIANTS:
            result = run_once(a, data, name, Path(a.out) / f"{name}-{r}")
            rounds[name].append(result)
            print(
                f"round {r} {name:15s} {result['ms']:8.1f} ms/iteration (first {result['first_ms']:.0f} ms)"
            )
    best = {name: min(x["ms"] for x in runs) for name, runs in rounds.items()}
    summary = {
        "best_ms": best,
        "fsdp2_over_zero3": best["fsdp2"] / best["zero3"],
        "eager_over_compiled": best["fsdp2"] / best["fsdp2_compiled"],
        "compiled_first_ms": [x["first_ms"] for x in rounds["fsdp2_compiled"]],
        "eager_first_ms": [x["first_ms"] for x in rounds["fsdp2"]],
        "losses_equal": {
            name: max(
                abs(p - q) / q for p, q in zip(runs[0]["losses"], rounds["fsdp2"][0]["losses"], strict=True)
            )
            for name, runs in rounds.items()
        },
        "rounds": rounds,
    }
    Path(a.out, "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="gloo ranks, all data parallel")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3, help="iterations left out of the timing")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of every variant, in turn")
    p.add_argument("--out", default="runs/bench_fsdp2_vs_zero3")
    a = p.parse_args()
    s = bench(a)
    print(f"best round, median ms/iteration after {a.warmup} warm-up iterations: " + ", ".join(
        f"{name} {ms:.1f}" for name, ms in s["best_ms"].items()))  # fmt: skip
    print(f"FSDP2 / ZeRO-3 step-time ratio: {s['fsdp2_over_zero3']:.3f} (target <= 1.1)")
    print(f"eager / compiled (FSDP2) step-time ratio: {s['eager_over_compiled']:.3f}; first iteration "
          f"eager {s['eager_first_ms']} ms, compiled {s['compiled_first_ms']} ms")  # fmt: skip
    print("largest relative loss difference to FSDP2 eager: " + ", ".join(
        f"{name} {d:.1e}" for name, d in s["losses_equal"].items()))  # fmt: skip


if __name__ == "__main__":
    main()
