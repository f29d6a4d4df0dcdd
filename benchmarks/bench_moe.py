"""MoE step time and tokens per expert for ep = 1, 2, 4 (and the aux loss's effect on balance).

Each run trains the same MoE GPT on ``--world`` local gloo ranks (dp = world, E experts,
top-k) with ``--expert-model-parallel-size`` ep: the same tokens and the same experts, so the
per-rank compute is the same (k N expert rows per micro-batch) and what changes is where the
experts live (E / ep per rank: parameter memory / ep) and the two all-to-alls per MoE layer and
direction that ep > 1 adds. Prints, per run: ms / iteration (mean after the first), parameters on
rank 0, tokens per expert of layer 0 at the last iteration and their max / mean imbalance; writes
every run's log and a JSON summary under ``--out``.

    python benchmarks/bench_moe.py --out runs/bench_moe                    # ep 1, 2, 4 on 4 ranks
    python benchmarks/bench_moe.py --eps 1 --aux-loss-coeffs 0 0.01 --train-iters 30   # the aux loss alone
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from distlab.gpt.build import PARAMETERS
from distlab.local_runs import prepare_data, spawn_pretrain
from distlab.logs.experts import expert_load, imbalance
from distlab.logs.megatron import throughput


def model_argv(a: argparse.Namespace) -> list[str]:
    """The run's flags: a small GPT with a MoE MLP in every block (Megatron's spellings)."""
    return (
        f"--num-layers {a.num_layers} --hidden-size {a.hidden_size} --num-attention-heads 4 "
        f"--seq-length {a.seq_length} --micro-batch-size {a.micro_batch_size} "
        f"--global-batch-size {a.micro_batch_size * a.world} --train-iters {a.train_iters} --lr 1e-3 "
        f"--log-interval 1 --eval-interval {a.train_iters} --eval-iters 0 --split 949,50,1 "
        f"--distributed-backend gloo --num-experts {a.num_experts} --moe-router-topk {a.topk} "
        f"--moe-token-dispatcher-type alltoall"
    ).split()


def bench(a: argparse.Namespace) -> list[dict]:
    data = prepare_data(Path(a.out) / "data", vocab_size=512, max_files=40).argv()
    rows = []
    for coeff in a.aux_loss_coeffs:
        for ep in a.eps:
            name = f"ep{ep}-aux{coeff:g}"
            argv = [
                *model_argv(a),
                *data,
                "--expert-model-parallel-size",
                str(ep),
                "--moe-aux-loss-coeff",
                str(coeff),
            ]
            result = spawn_pretrain(argv, a.world, Path(a.out) / name)
            log = result.log
            its, counts, aux = expert_load(log, layer=0)
            row = {
                "run": name,
                "ep": ep,
                "aux_loss_coeff": coeff,
                "ms_per_iter": throughput(log, devices=a.world)["ms_per_iter"],
                "parameters_rank0": PARAMETERS.search(log)["parameters"],
                "tokens_per_expert_last": counts[-1].tolist(),
                "imbalance_last": float(imbalance(counts)[-1]),
                "imbalance_mean": float(np.mean(imbalance(counts))),
                "load_balancing_loss_last": float(aux[-1]),
                "loss_last": result.last["losses"][-1],
            }
            print(
                f"{name}: {row['ms_per_iter']:.1f} ms/iter | parameters on rank 0 {row['parameters_rank0']:,} | "
                f"layer 0 tokens per expert {row['tokens_per_expert_last']} (imbalance {row['imbalance_last']:.2f}, "
                f"mean over steps {row['imbalance_mean']:.2f}) | lm loss {row['loss_last']:.4f}",
                flush=True,
            )
            rows.append(row)
    (Path(a.out) / "summary.json").write_text(json.dumps(rows, indent=1))
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench_moe", help="logs and summary.json go here")
    p.add_argument("--world", type=int, default=4, help="ranks (all data-parallel)")
    p.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4], help="expert-model-parallel sizes to run")
    p.add_argument(
        "--aux-loss-coeffs", type=float, nargs="+", default=[0.01], help="--moe-aux-loss-coeff values"
    )
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--train-iters", type=int, default=6)
    a = p.parse_args(argv)
    bad = [ep for ep in a.eps if a.world % ep or a.num_experts % ep]
    if bad:
        p.error(f"--eps {bad} must divide --world {a.world} (dp) and --num-experts {a.num_experts}")
    return a


if __name__ == "__main__":
    bench(parse())
