"""How much does pretrain_gpt.py cost over a plain PyTorch loop, and how fast is it here?

1. Overhead: the same model (same seed, same config), the same batches and the same optimizer,
   trained at world size 1 by ``pretrain`` (its whole iteration: batch, step, logging) and by a
   minimal loop (batch, forward, backward, clip, AdamW step), alternately in this one process
   (a process group of one for ``pretrain``), a few rounds, because the machine may be shared.
   Printed: median step times and their ratio (target: at most 1.02).
2. Throughput of ``pretrain`` at world size 1 for a tiny, a small and a GPT-2-small-sized model
   (12 layers, width 768, 12 heads, 1024 tokens; the vocabulary is the offline 4096-token one,
   not GPT-2's 50257). Printed: tokens per second and TFLOP/s.

    python benchmarks/bench_pretrain_gpt.py              # all; data prepared in data/gpt/bench
    python benchmarks/bench_pretrain_gpt.py --skip-gpt2  # without the slow GPT-2-small config
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import tempfile
import time

import torch

from distlab import REPO_ROOT
from distlab.gpt.arguments import parse_args, parse_split, validate_args
from distlab.gpt.arguments.to_configs import lr_schedule, optimizer_config
from distlab.gpt.data.gpt_dataset import build_datasets
from distlab.gpt.data.tokenizer import GPT2BPETokenizer
from distlab.gpt.optimizer.optimizer import build_optimizer
from distlab.gpt.pretrain import pretrain
from distlab.gpt.tensor_parallel.layers import pad_vocab_size
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.local_ranks import free_port
from distlab.local_runs import prepare_data, spawn_pretrain
from distlab.rank_process import usable_cpus

#                name         layers hidden heads seq micro  (global batch = micro: world size 1)
CONFIGS = {
    "tiny": (2, 64, 4, 64, 8),
    "small": (6, 256, 8, 256, 4),
    "gpt2-small": (12, 768, 12, 1024, 1),
}


def argv_for(name: str, iters: int, data: list[str]) -> list[str]:
    L, h, n, s, m = CONFIGS[name]
    return ["--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads", str(n), "--seq-length", str(s),
            "--micro-batch-size", str(m), "--global-batch-size", str(m), "--train-iters", str(iters),
            "--lr", "1e-4", "--lr-decay-style", "constant", "--split", "99,1,0", "--eval-interval", str(10 * iters),
            "--eval-iters", "0", "--log-interval", str(iters), *data]  # fmt: skip


def plain_loop(argv: list[str]) -> list[float]:
    """The same training, written as short as PyTorch allows; milliseconds per step."""
    args = parse_args(argv)
    validate_args(args, 1)
    torch.set_num_threads(usable_cpus())
    vocab = pad_vocab_size(GPT2BPETokenizer(args.vocab_file, args.merge_file).vocab_size, 128, 1)
    cfg = GPTConfig(args.num_layers, args.hidden_size, args.num_attention_heads, vocab, args.seq_length,
                    seed=args.seed)  # fmt: skip
    model = GPTModel(cfg)
    opt = build_optimizer(model, optimizer_config(args))
    lr_schedule(args).apply(opt, 1)
    train = build_datasets(args.data_path, parse_split(args.split), args.seq_length,
                           [args.train_iters * args.global_batch_size, 0, 0], args.seed)[0]  # fmt: skip
    times = []
    for it in range(args.train_iters):
        t0 = time.perf_counter()
        tokens, labels = train.batch(range(it * args.micro_batch_size, (it + 1) * args.micro_batch_size))
        opt.zero_grad(set_to_none=True)
        model(tokens, labels).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
        times.append(1000 * (time.perf_counter() - t0))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--overhead-config", default="small", choices=list(CONFIGS))
    p.add_argument("--iters", type=int, default=20, help="steps per overhead run (first 3 not counted)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of pretrain / plain loop")
    p.add_argument("--skip-gpt2", action="store_true")
    args = p.parse_args()
    data = prepare_data(REPO_ROOT / "data" / "gpt" / "bench", vocab_size=4096).argv()
    print(
        f"machine: {usable_cpus()} usable cores, torch {torch.__version__}, CUDA: {torch.cuda.is_available()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        argv = argv_for(args.overhead_config, args.iters, data)
        ours, plain = [], []
        for r in range(args.rounds):
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip
            with contextlib.redirect_stdout(io.StringIO()):
                history = pretrain(argv)
            ours.append(history["iter_ms"][3:])
            plain.append(plain_loop(argv)[3:])
            if r == 0:
                ref = history["losses"]
        print(
            f"\n[overhead, config {args.overhead_config}, world size 1, steps 4..{args.iters}, {args.rounds} rounds]"
        )
        for name, runs in (("pretrain_gpt.py", ours), ("plain loop", plain)):
            medians = ", ".join(f"{statistics.median(t):.1f}" for t in runs)
            print(
                f"  {name:15s}: fastest step {min(map(min, runs)):8.1f} ms, best round median "
                f"{min(map(statistics.median, runs)):8.1f} ms   (round medians: {medians})"
            )
        print(
            f"  ratio          : {min(map(min, ours)) / min(map(min, plain)):.3f} (fastest steps), "
            f"{min(map(statistics.median, ours)) / min(map(statistics.median, plain)):.3f} (best medians); "
            f"target <= 1.02"
        )
        print(f"  first losses    : {', '.join(f'{x:.4f}' for x in ref[:3])}")
        print("\n[throughput, world size 1]")
        for name in CONFIGS:
            if name == "gpt2-small" and args.skip_gpt2:
                continue
            iters = 4 if name == "gpt2-small" else 10
            run = spawn_pretrain(argv_for(name, iters, data), 1, f"{tmp}/{name}")
            line = next(x for x in run.logs[0].splitlines() if x.startswith(" iteration"))
            params = (
                next(x for x in run.logs[0].splitlines() if "number of parameters" in x)
                .split(":")[-1]
                .strip()
            )
            ms = statistics.median(run.last["iter_ms"][1:])
            L, h, n, s, m = CONFIGS[name]
            tflops = line.split("TFLOP/s per device: ")[1].split(" ")[0]
            print(
                f"  {name:11s} L={L:2d} h={h:4d} heads={n:2d} seq={s:4d} batch={m}: {int(params) / 1e6:7.2f} M params, "
                f"{ms:9.1f} ms/step, {m * s / ms * 1000:9.1f} tokens/s (median), TFLOP/s {tflops} (log line)"
            )


if __name__ == "__main__":
    main()
