"""Megatron-format log lines, TensorBoard scalars and model FLOPs.

Model FLOPs of one iteration (Megatron's formula; activation recomputation adds a forward,
factor 4 instead of 3 = forward + 2 x backward), with B samples of length s, L layers, width h,
vocabulary V::

    F = 24 c B s L h^2 (1 + s / (6 h) + V / (16 L h)),   c = 3 (or 4 with recomputation)

    TFLOP/s per device = F / (time per iteration x world size) / 1e12
    MFU                = TFLOP/s per device / peak of the device (when known)
"""

from __future__ import annotations

import os
import re
import time

import torch

from distlab.gpt.arguments import PretrainArgs

#: Dense bf16/fp16 tensor-core peaks (TFLOP/s) by a substring of the device name.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "V100": 125.0,
    "L4": 121.0,
    "T4": 65.0,
}


def model_flops_per_iteration(args: PretrainArgs, vocab_size: int) -> float:
    """Forward + backward FLOPs of one global batch (see the module docstring)."""
    B, s, L, h = args.global_batch_size, args.seq_length, args.num_layers, args.hidden_size
    c = 4 if args.recompute_activations else 3
    return 24.0 * c * B * s * L * h * h * (1.0 + s / (6.0 * h) + vocab_size / (16.0 * L * h))


def device_peak_tflops(device: torch.device) -> float | None:
    """Peak TFLOP/s of the device, or None where unknown (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    lr: float,
    global_batch_size: int,
    loss: float,
    loss_scale: float,
    grad_norm: float | None,
    skipped: int,
    nan: int,
    tokens_per_s: float,
    tflops_per_device: float,
    mfu: float | None,
) -> str:
    """Megatron's training log line, then throughput fields."""
    line = (
        f" iteration {iteration:8d}/{train_iters:8d} |"
        f" consumed samples: {consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
        f" learning rate: {lr:.3E} |"
        f" global batch size: {global_batch_size:5d} |"
        f" lm loss: {loss:.6E} |"
        f" loss scale: {loss_scale:.1f} |"
    )
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += (
        f" number of skipped iterations: {skipped:3d} |"
        f" number of nan iterations: {nan:3d} |"
        f" tokens per second: {tokens_per_s:.1f} |"
        f" TFLOP/s per device: {tflops_per_device:.3f} |"
    )
    if mfu is not None:
        line += f" MFU: {100 * mfu:.1f}% |"
    return line


#: What the notebooks grep for; tests check ``iteration_line`` against it.
ITERATION_RE = re.compile(
    r"^ iteration +(?P<it>\d+)/ +(?P<total>\d+) \| consumed samples: +(?P<samples>\d+) \|"
    r" elapsed time per iteration \(ms\): (?P<ms>[\d.]+) \| learning rate: (?P<lr>[\d.E+-]+) \|"
    r" global batch size: +(?P<gbs>\d+) \| lm loss: (?P<loss>[\d.E+-]+|NAN|INF) \|"
    r" loss scale: (?P<scale>[\d.]+) \|( grad norm: (?P<gnorm>[\d.]+|nan|inf) \|)?"
    r" number of skipped iterations: +(?P<skipped>\d+) \| number of nan iterations: +(?P<nan>\d+) \|"
)


def validation_lines(label: str, loss: float) -> list[str]:
    """Megatron's boxed validation report: loss and perplexity."""
    ppl = float("inf") if loss > 700 else float(torch.tensor(loss).exp())
    body = f" validation loss at {label} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    bar = "-" * (len(body) + 1)
    return [bar, body, bar]


class Timer:
    """Wall-clock seconds of a region; synchronises CUDA so GPU time is counted."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.total, self._start = device, 0.0, None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        dt = time.perf_counter() - self._start
        self.total += dt
        return dt

    def pop(self) -> float:
        t, self.total = self.total, 0.0
        return t


class TensorBoardLog:
    """Megatron's TensorBoard tags, written by one rank; a no-op without ``--tensorboard-dir``."""

    def __init__(self, args: PretrainArgs, enabled: bool) -> None:
        self.args, self.writer = args, None
        if enabled and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)

    def training(
        self,
        iteration: int,
        samples: int,
        *,
        loss: float,
        lr: float,
        loss_scale: float,
        grad_norm: float | None,
        iter_ms: float,
        timers: dict[str, float],
    ) -> None:
        w, a = self.writer, self.args
        if w is None:
            return
        w.add_scalar("learning-rate", lr, iteration)
        w.add_scalar("learning-rate vs samples", lr, samples)
        if a.log_batch_size_to_tensorboard:
            w.add_scalar("batch-size", a.global_batch_size, iteration)
            w.add_scalar("batch-size vs samples", a.global_batch_size, samples)
        w.add_scalar("lm loss", loss, iteration)
        w.add_scalar("lm loss vs samples", loss, samples)
        if a.fp16:
            w.add_scalar("loss-scale", loss_scale, iteration)
            w.add_scalar("loss-scale vs samples", loss_scale, samples)
        if grad_norm is not None:
            w.add_scalar("grad-norm", grad_norm, iteration)
            w.add_scalar("grad-norm vs samples", grad_norm, samples)
        if a.log_timers_to_tensorboard:
            w.add_scalar("iteration-time", iter_ms / 1000.0, iteration)
            for name, ms in timers.items():
                w.add_scalar(f"{name}-time", ms, iteration)

    def validation(self, iteration: int, samples: int, loss: float) -> None:
        w = self.writer
        if w is None:
            return
        w.add_scalar("lm loss validation", loss, iteration)
        w.add_scalar("lm loss validation vs samples", loss, samples)
        if self.args.log_validation_ppl_to_tensorboard:
            ppl = float(torch.tensor(min(loss, 700.0)).exp())
            w.add_scalar("lm loss validation ppl", ppl, iteration)
            w.add_scalar("lm loss validation ppl vs samples", ppl, samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class TrainingLog:
    """Per-iteration history plus Megatron's line every ``--log-interval`` iterations.

    The line averages loss and time over the interval and counts its skipped / nan iterations;
    ``history`` keeps every iteration (tests and notebooks read it).
    """

    def __init__(self, args: PretrainArgs, *, vocab_size: int, world_size: int, device: torch.device) -> None:
        self.args, self.world_size = args, world_size
        self.flops = model_flops_per_iteration(args, vocab_size)
        self.peak = device_peak_tflops(device)
        self.timer = Timer(device)
        self.history: dict = {
            k: []
            for k in ("iterations", "losses", "loss_scales", "grad_norms", "lrs", "val_losses", "iter_ms")
        }
        self.history.update(skipped=0, nan=0)
        self._losses: list[float] = []
        self._skipped = self._nan = 0
        self.timer.start()
        self._last = time.perf_counter()

    def record(
        self,
        iteration: int,
        consumed: int,
        *,
        loss: float,
        grad_norm: float | None,
        skipped: bool,
        nan: bool,
        lr: float,
        loss_scale: float,
    ) -> str | None:
        """Add one iteration; return the log line when one is due."""
        h, now = self.history, time.perf_counter()
        h["iter_ms"].append(1000 * (now - self._last))  # whole iteration: data, step, logging
        self._last = now
        for key, val in (
            ("iterations", iteration),
            ("losses", loss),
            ("loss_scales", loss_scale),
            ("grad_norms", grad_norm),
            ("lrs", lr),
        ):
            h[key].append(val)
        h["skipped"] += skipped
        h["nan"] += nan
        self._skipped += skipped
        self._nan += nan
        if not nan:  # a skipped fp16 step still has a true forward loss
            self._losses.append(loss)
        a = self.args
        if iteration % a.log_interval and iteration != a.train_iters:
            return None
        n = (iteration - 1) % a.log_interval + 1
        iter_s = self.timer.stop() / n
        tflops = self.flops / iter_s / self.world_size / 1e12
        line = iteration_line(
            iteration=iteration, train_iters=a.train_iters, consumed_samples=consumed, elapsed_ms=1000 * iter_s,
            lr=lr, global_batch_size=a.global_batch_size,
            loss=sum(self._losses) / len(self._losses) if self._losses else float("nan"), loss_scale=loss_scale,
            grad_norm=grad_norm, skipped=self._skipped, nan=self._nan,
            tokens_per_s=a.global_batch_size * a.seq_length / iter_s, tflops_per_device=tflops,
            mfu=tflops / self.peak if self.peak else None,
        )  # fmt: skip
        self._losses, self._skipped, self._nan = [], 0, 0
        self.timer.pop()
        self.timer.start()
        return line


class StepProfiler:
    """torch.profiler over the first three steps of rank 0: one warm-up, two traced.

    The trace lands in ``<tensorboard-dir>/<profile-name>/rank0.<time>.pt.trace.json``, the layout
    TensorBoard's PyTorch Profiler plugin reads (``tensorboard --logdir <tensorboard-dir>``).
    """

    def __init__(self, args: PretrainArgs, rank: int) -> None:
        self.folder = os.path.join(
            args.tensorboard_dir or os.path.join("runs", "tensorboard"), args.profile_name
        )
        self.prof, self.steps = None, 0
        if not args.profile_execution or rank != 0:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=acts, schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.folder, "rank0"), record_shapes=True,
        )  # fmt: skip
        self.prof.start()
        print(
            f"> profiling two training steps of rank 0 into {self.folder} (TensorBoard PyTorch Profiler)",
            flush=True,
        )

    def step(self) -> None:
        if self.prof is None:
            return
        self.prof.step()
        self.steps += 1
        if self.steps == 3:
            self.stop()
            print(f"> profiler trace written under {self.folder}", flush=True)

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
