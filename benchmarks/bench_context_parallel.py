"""Context parallelism at a fixed long sequence: tokens/s and peak memory per rank for cp = 1, 2, 4.

The same GPT and the same global batch run on ``--world`` local gloo ranks as world = cp x dp:
cp = 1 is plain data parallelism (every rank a whole sequence), cp = 4 one ring of 4 ranks
splitting every sequence (``--context-parallel-size``, ring attention, load-balanced causal
chunks). Per run it prints ms/iteration and tokens/s (after the first iteration), the peak above
the memory before the model that rank 0 measured and the estimator's prediction
(``> memory: predicted peak ... | measured ...``), and the largest peak resident set of any rank.
Logs and a JSON summary go to ``--out``::

    python benchmarks/bench_context_parallel.py                      # s = 2048, cp 1, 2, 4 on 4 ranks
    python benchmarks/bench_context_parallel.py --seq-length 4096 --cps 2 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from distlab import REPO_ROOT
from distlab.gpt.memory.meters import MEMORY
from distlab.local_runs import prepare_data, spawn_pretrain
from distlab.logs.megatron import throughput
from distlab.logs.memory import prediction


def model_argv(a: argparse.Namespace, cp: int) -> list[str]:
    """The run's flags (Megatron's spellings): one micro-batch per data-parallel rank and step."""
    return (
        f"--num-layers {a.num_layers} --hidden-size {a.hidden_size} --num-attention-heads 4 "
        f"--seq-length {a.seq_length} --max-position-embeddings {a.seq_length} --micro-batch-size 1 "
        f"--global-batch-size {a.global_batch_size} --train-iters {a.train_iters} --lr 1e-3 --log-interval 1 "
        f"--eval-iters 0 --split 100,0,0 --attention-dropout 0 --distributed-backend gloo "
        f"--context-parallel-size {cp}"
    ).split()


def bench(a: argparse.Namespace) -> list[dict]:
    data = prepare_data(REPO_ROOT / "data" / "gpt" / "bench", vocab_size=4096).argv()
    rows = []
    for cp in a.cps:
        result = spawn_pretrain([*data, *model_argv(a, cp)], a.world, Path(a.out) / f"cp{cp}")
        log = "\n".join(result.logs)
        speed = throughput(result.logs[-1], devices=a.world)
        memory = prediction(log)
        row = {
            "cp": cp,
            "dp": a.world // cp,
            "seq_length": a.seq_length,
            "ms_per_iter": speed["ms_per_iter"],
            "tokens_per_s": speed["tokens_per_s"],
            "measured_peak_mib": memory.get("measured"),
            "predicted_peak_mib": memory.get("predicted"),
            "max_peak_rss_mib": max(r["peak_mib"] for r in MEMORY.parse(log)),
        }
        print(
            f"cp {cp} x dp {row['dp']}, s {a.seq_length}: {row['ms_per_iter']:.0f} ms/iter, "
            f"{row['tokens_per_s']:.0f} tokens/s | rank 0 peak above the model's start "
            f"{row['measured_peak_mib']:.1f} MiB (predicted {row['predicted_peak_mib']:.1f}) | "
            f"largest peak RSS {row['max_peak_rss_mib']:.0f} MiB",
            flush=True,
        )
        rows.append(row)
    (Path(a.out) / "summary.json").write_text(json.dumps(rows, indent=1))
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench_context_parallel", help="logs and summary.json go here")
    p.add_argument("--world", type=int, default=4, help="ranks: cp x dp")
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes to run")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=4)
    p.add_argument("--train-iters", type=int, default=4)
    a = p.parse_args(argv)
    bad = [
        cp for cp in a.cps if a.world % cp or a.seq_length % (2 * cp) or a.global_batch_size % (a.world // cp)
    ]
    if bad:
        p.error(
            f"--cps {bad}: each must divide --world {a.world}, 2 x cp must divide --seq-length {a.seq_length}, "
            f"and the data-parallel size world / cp must divide --global-batch-size {a.global_batch_size}"
        )
    return a


if __name__ == "__main__":
    bench(parse())
