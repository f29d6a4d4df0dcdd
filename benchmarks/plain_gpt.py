"""A plain GPT training loop in one file: the yardstick ``gpu_check.py`` holds the engine against.

Written the way a nanoGPT-style script is written, with nothing from ``distlab``: learned position
embeddings, pre-LayerNorm blocks (fused QKV, ``scaled_dot_product_attention`` with a causal mask,
a 4H GELU MLP), a final LayerNorm and an output layer tied to the token embedding; no dropout (the
engine's default); bf16 autocast on CUDA; ``torch.optim.AdamW(fused=True)``; gradient clipping at
1.0; batches of random windows from the same ``.bin`` token file the engine reads, copied from
pinned memory with ``non_blocking=True``. The step time is measured from CUDA events between steps;
nothing in the loop reads a value back to the host.

    python benchmarks/plain_gpt.py --data data/gpt/bpe4096/stdlib_text_document.bin \\
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 \\
        --micro-batch-size 16 --vocab-size 4096 --iters 30 [--compile]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h)
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, s, h/heads)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's initialisation; residual projections scaled by 1/sqrt(2L)
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # (b, s) -> ()
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # (b, s, V)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def batches(path: str, b: int, s: int, device: torch.device, seed: int = 0):
    """Random (tokens, labels) windows of the token file, staged in pinned memory, copied async."""
    data = np.memmap(path, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - s - 1, b)
        window = torch.from_numpy(np.stack([data[i : i + s + 1] for i in starts]).astype(np.int64))
        if device.type == "cuda":
            window = window.pin_memory()
        window = window.to(device, non_blocking=True)
        yield window[:, :-1], window[:, 1:]


def train(args: argparse.Namespace) -> dict:
    """Train ``args.iters`` steps; milliseconds per step (CUDA events; wall clock on a CPU)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(1234)
    model = GPT(args.num_layers, args.hidden_size, args.num_attention_heads, args.vocab_size, args.seq_length)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    step_model = torch.compile(model) if args.compile else model
    data = batches(args.data, args.micro_batch_size, args.seq_length, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> torch.Tensor:
        tokens, labels = next(data)
        with autocast:
            loss = step_model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    timer = Timer(device)
    losses = []
    for _ in range(args.iters):
        timer.mark()
        losses.append(step())
    timer.mark()
    out = {"ms": timer.intervals(), "loss": [float(x) for x in losses[-3:]]}
    if args.profile_dir:
        out["trace"] = profile(step, device, Path(args.profile_dir))
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


class Timer:
    """Marks between steps: CUDA events, read once at the end, or the wall clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            import time

            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in pairwise(self.marks)]
        return [1000 * (b - a) for a, b in pairwise(self.marks)]


def profile(step, device: torch.device, folder: Path, steps: int = 2) -> str:
    """A torch.profiler trace of ``steps`` steps after the timed ones; its path."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    folder.mkdir(parents=True, exist_ok=True)
    # the options the engine's StepProfiler uses, so that both traces carry the same overhead
    with torch.profiler.profile(
        activities=acts, record_shapes=True, profile_memory=True, with_stack=True
    ) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("ProfilerStep"):
                step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    path = folder / "plain.pt.trace.json"
    prof.export_chrome_trace(str(path))
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a token file (uint16) as preprocess_data.py writes it")
    for name, default in (("num-layers", 12), ("hidden-size", 768), ("num-attention-heads", 12),
                          ("seq-length", 1024), ("micro-batch-size", 16), ("vocab-size", 4096), ("iters", 30)):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    p.add_argument("--profile-dir", help="also trace two steps after the timed ones into this folder")
    args = p.parse_args(argv)
    if not Path(args.data).exists():
        p.error(f"--data {args.data}: no such file; prepare it with code/preprocess_data.py")
    out = train(args)
    print(json.dumps(out))
    print(f"median step {statistics.median(out['ms'][args.iters // 2 :]):.1f} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
