"""GPU check (never in CI): GPT-2-small through pretrain_gpt.py on one CUDA GPU, and its figures.

Runs ``code/pretrain_gpt.py`` under ``torchrun --standalone --nproc-per-node=1`` (world size 1,
``--distributed-backend nccl``) with GPT-2-small's shape (12 layers, hidden 768, 12 heads, 1024
tokens) in bf16, then prints:

* tokens/s and MFU, medians of the logged intervals after the first (warm-up) one. MFU = model
  FLOPs per second (Megatron's formula, ``distlab.gpt.training.log``) / the device's dense bf16 peak
  (``distlab.gpt.training.flops.PEAK_TFLOPS``; 989 TFLOP/s for an H100 SXM; target: at least 50%);
* the engine's per-rank memory report after the first iteration, whose peak is
  ``torch.cuda.max_memory_allocated``;
* the profiler trace of two steps (``--profile-execution True``) as TensorBoard's PyTorch Profiler
  plugin reads it (``torch_tb_profiler``): kernels found, the share of GPU time in tensor-core
  kernels, and the step's GPU busy share.

The vocabulary is the offline byte-level BPE (``--vocab-size``, 4096 by default, trained on Python
docstrings), not GPT-2's 50,257 tokens: the logits layer is smaller, and Megatron's FLOP count
accounts for it. Record the printed figures, with the GPU's name and the date, in README's
performance section.

    python benchmarks/gpu_check.py                           # a few minutes on an H100
    python benchmarks/gpu_check.py --micro-batch-size 16     # a larger batch, if memory allows
    tensorboard --logdir runs/gpu_check/tensorboard          # the trace (PyTorch Profiler tab)
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from distlab import REPO_ROOT
from distlab.gpt.tools.local_run import prepare_data

FIELD = r"{}: ([\d.]+)"


def gpt2_small_argv(args: argparse.Namespace, data: list[str], out: Path) -> list[str]:
    # global batch = micro batch (world size 1, no accumulation); tokens per step = micro x 1024
    m = str(args.micro_batch_size)
    return ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
            "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", m,
            "--global-batch-size", m, "--train-iters", str(args.train_iters), "--bf16",
            "--lr", "1e-4", "--lr-decay-style", "constant", "--split", "99,1,0",
            "--eval-interval", str(10 * args.train_iters), "--eval-iters", "0",
            "--log-interval", str(args.log_interval), "--distributed-backend", "nccl",
            "--tensorboard-dir", str(out / "tensorboard"), "--profile-execution", "True",
            "--profile-name", "gpt2-small", *data]  # fmt: skip


def throughput(log: str) -> tuple[float, float | None, float]:
    """Medians of tokens/s, MFU (%) and TFLOP/s over the iteration lines after the first."""
    lines = [x for x in log.splitlines() if x.startswith(" iteration")][1:]
    if not lines:
        raise SystemExit("gpu_check: no iteration line after the first: raise --train-iters")

    def median(name: str) -> float | None:
        found = [float(m.group(1)) for x in lines if (m := re.search(FIELD.format(name), x))]
        return statistics.median(found) if found else None

    return median("tokens per second"), median("MFU"), median("TFLOP/s per device")


def trace_summary(folder: Path) -> str:
    """Load the newest trace the way TensorBoard's PyTorch Profiler plugin does, and summarise it."""
    from torch_tb_profiler.profiler.data import RunProfileData

    traces = sorted(folder.glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise SystemExit(f"gpu_check: no profiler trace under {folder}")
    with tempfile.TemporaryDirectory() as cache:
        profile = RunProfileData.parse("rank0", None, str(traces[-1]), cache)
    if not profile.has_kernel:
        raise SystemExit(f"gpu_check: {traces[-1]} holds no CUDA kernel: was the GPU used?")
    busy = profile.gpu_metrics_parser.gpu_utilization[min(profile.gpu_metrics_parser.gpu_ids)]
    return (
        f"{traces[-1]}: loaded by torch_tb_profiler: {len(profile.kernel_list_groupby_name_op)} "
        f"(kernel, operator) pairs, tensor-core share of kernel time {profile.tc_used_ratio:.1f}%, "
        f"GPU busy {100 * busy:.1f}% of the traced steps"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences of 1024 tokens per step")
    p.add_argument("--train-iters", type=int, default=60)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--vocab-size", type=int, default=4096, help="of the offline BPE tokenizer")
    p.add_argument("--out", default=str(REPO_ROOT / "runs" / "gpu_check"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU is visible here (torch.cuda.is_available() is False), so there "
            "is nothing to measure. Run it on a GPU node, e.g. `srun --gpus=1 --time=00:20:00 "
            "python benchmarks/gpu_check.py`.",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    data = prepare_data(REPO_ROOT / "data" / "gpt" / f"bpe{args.vocab_size}", args.vocab_size).argv()
    cmd = ["torchrun", "--standalone", "--nproc-per-node=1", str(REPO_ROOT / "code" / "pretrain_gpt.py")]
    run = subprocess.run(
        [*cmd, *gpt2_small_argv(args, data, out)], capture_output=True, text=True, timeout=1800
    )
    (out / "pretrain.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "pretrain.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        print(run.stdout[-3000:] + run.stderr[-3000:], file=sys.stderr)
        return run.returncode
    tokens, mfu, tflops = throughput(run.stdout)
    name = torch.cuda.get_device_name(0)
    print(f"device: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(
        f"GPT-2-small (12 x 768, 12 heads, seq 1024, vocab {args.vocab_size}) bf16, micro batch "
        f"{args.micro_batch_size}: {tokens:,.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU "
        + (f"{mfu:.1f}%" if mfu is not None else "unknown (device not in PEAK_TFLOPS)")
    )
    print("\n".join(x for x in run.stdout.splitlines() if "memory (MiB)" in x))
    print(trace_summary(out / "tensorboard" / "gpt2-small"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
