"""Megatron-format log lines, TensorBoard scalars, the one timer of the training loop, and the
torch.profiler traces of training steps (in the layout TensorBoard's PyTorch Profiler reads).

The throughput fields of the iteration line (tokens/s, TFLOP/s per device, MFU) come from
``flops.py``'s model FLOPs. What is logged where is a :class:`LoggingConfig`, what is traced a
:class:`ProfilerConfig` (Megatron-LM's logging and profiling flags, mapped by ``arguments/to_configs.py``).

A step leaves its loss, gradient norm and skip / nan flags on the device (``StepResult``);
:class:`TrainingLog` keeps them there and reads the whole interval's with one copy to the host
on the iterations that log (as Megatron's ``training_log`` accumulates ``total_loss_dict`` on the
device and reads it every ``--log-interval``), and :class:`Timer` waits for the device only then:
between two log lines the host runs ahead of the device and never waits for it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from distlab.gpt.interfaces import DeviceScalar
from distlab.gpt.training.flops import device_peak_tflops
from distlab.log_line import LogLine, Opt

#: Megatron's training line (averages over the log interval), then this engine's throughput.
ITERATION = LogLine(
    " iteration {it:8d}/{total:8d} | consumed samples: {samples:12d} |"
    " elapsed time per iteration (ms): {ms:.1f} |",
    Opt(" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"),  # --log-throughput
    " learning rate: {lr:.3E} | global batch size: {gbs:5d} | lm loss: {loss:.6E} | loss scale: {scale:.1f} |",
    Opt(" grad norm: {gnorm:.3f} |"),
    " number of skipped iterations: {skipped:3d} | number of nan iterations: {nan:3d} |",
    Opt(" tokens per second: {tokens_per_s:.1f} | TFLOP/s per device: {tflops:.3f} |"),
    Opt(" MFU: {mfu_percent:.1f}% |"),
)
#: The body of Megatron's boxed validation report.
VALIDATION = LogLine(" validation loss at {label} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | ")


@dataclass(frozen=True)
class LoggingConfig:
    """The iteration line and TensorBoard: the run's length and batch, and Megatron-LM's logging flags."""

    train_iters: int
    """Iterations of the run (the line's total; its last iteration always logs)."""
    global_batch_size: int
    """B, the final global batch (a ramp's steps log their own)."""
    seq_length: int
    """s, for tokens per second."""
    log_interval: int = 100
    """Iterations between log lines."""
    log_throughput: bool = False
    """Add Megatron's TFLOP/s per device field."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (None: none)."""
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_batch_size_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_loss_scale_to_tensorboard: bool = False
    """The loss scale (fp16's dynamic one) as a scalar."""


@dataclass(frozen=True)
class ProfilerConfig:
    """Which ranks and iterations are traced, and where (Megatron-LM's profiling flags)."""

    profile_execution: bool = False
    """torch.profiler traces of iterations ``profile_step_start + 1 .. profile_step_end``."""
    profile: bool = False
    """Without ``use_pytorch_profiler``: an nsys capture range of the same iterations (CUDA only)."""
    use_pytorch_profiler: bool = False
    profile_ranks: frozenset[int] = frozenset()
    """Global ranks that trace; empty: every rank (Megatron's default)."""
    profile_step_start: int = 10
    """The warm-up iteration."""
    profile_step_end: int = 12
    """The last traced iteration."""
    tensorboard_dir: str | None = None
    """Traces go under ``<tensorboard_dir>/<profile_name>`` (default folder ``runs/tensorboard``)."""
    profile_name: str = "profile"


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
    throughput: float | None = None,
) -> str:
    """Megatron's training log line, then throughput fields: :data:`ITERATION`
    (``throughput``: Megatron's --log-throughput field, model TFLOP/s per device)."""
    return ITERATION.format(
        throughput=throughput,
        it=iteration,
        total=train_iters,
        samples=consumed_samples,
        ms=elapsed_ms,
        lr=lr,
        gbs=global_batch_size,
        loss=loss,
        scale=loss_scale,
        gnorm=grad_norm,
        skipped=skipped,
        nan=nan,
        tokens_per_s=tokens_per_s,
        tflops=tflops_per_device,
        mfu_percent=None if mfu is None else 100 * mfu,
    )


#: What the notebooks grep for; tests check ``iteration_line`` against it.
ITERATION_RE = ITERATION.regex


def validation_lines(label: str, loss: float) -> list[str]:
    """Megatron's boxed validation report: loss and perplexity (:data:`VALIDATION`)."""
    ppl = float("inf") if loss > 700 else float(torch.tensor(loss).exp())
    body = VALIDATION.format(label=label, loss=loss, ppl=ppl)
    bar = "-" * (len(body) + 1)
    return [bar, body, bar]


def to_host(values: list) -> list:
    """``values`` with each tensor (0-d) among them replaced by its Python float, read with one
    copy per device (one synchronisation each); None, floats and bools pass through."""
    out = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for indices in by_device.values():
        # float64 holds every fp32 (and bool) value exactly: the same float as float(tensor)
        read = torch.stack([values[i].detach().reshape(()).double() for i in indices]).tolist()
        for i, x in zip(indices, read, strict=True):
            out[i] = x
    return out


class Timer:
    """Wall-clock seconds since the start and between laps. ``lap(sync=True)`` first waits for
    the device (CUDA) so that its queued work counts; unsynchronised laps measure the host, which
    runs ahead: their sum up to a synchronised lap is the elapsed time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sync()
        self.started = self._last = time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def lap(self, sync: bool = True) -> float:
        """Seconds since the previous lap (or the start)."""
        if sync:
            self._sync()
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        return dt

    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.started


class TensorBoardLog:
    """Megatron's TensorBoard tags, written by one rank; a no-op without ``--tensorboard-dir``."""

    def __init__(self, config: LoggingConfig, enabled: bool) -> None:
        self.config, self.writer = config, None
        if enabled and config.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(
                log_dir=config.tensorboard_dir, max_queue=config.tensorboard_queue_size
            )

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
        global_batch_size: int | None = None,
    ) -> None:
        """One iteration's scalars; ``global_batch_size``: this step's (a ramp's), else the final."""
        w, a = self.writer, self.config
        if w is None:
            return
        batch = global_batch_size or a.global_batch_size
        w.add_scalar("learning-rate", lr, iteration)
        w.add_scalar("learning-rate vs samples", lr, samples)
        if a.log_batch_size_to_tensorboard:
            w.add_scalar("batch-size", batch, iteration)
            w.add_scalar("batch-size vs samples", batch, samples)
        w.add_scalar("lm loss", loss, iteration)
        w.add_scalar("lm loss vs samples", loss, samples)
        if a.log_loss_scale_to_tensorboard:
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
        if self.config.log_validation_ppl_to_tensorboard:
            ppl = float(torch.tensor(min(loss, 700.0)).exp())
            w.add_scalar("lm loss validation ppl", ppl, iteration)
            w.add_scalar("lm loss validation ppl vs samples", ppl, samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass
class Interval:
    """What a log iteration read: Megatron's line and each iteration's values since the last one
    (``TrainingLog.ROW`` keys, Python numbers)."""

    line: str
    rows: list[dict]


class TrainingLog:
    """Per-iteration history plus Megatron's line every ``--log-interval`` iterations.

    The line averages loss and time over the interval and counts its skipped / nan iterations;
    ``history`` keeps every iteration (tests and notebooks read it), filled in at each log
    iteration, when the interval's device values are read at once (:func:`to_host`), and by
    :meth:`flush` at the end of a run.
    """

    ROW = ("iteration", "consumed", "loss", "grad_norm", "skipped", "nan", "lr", "loss_scale", "iter_ms",
           "step_ms", "batch")  # fmt: skip

    def __init__(self, config: LoggingConfig, *, flops: float, world_size: int, device: torch.device) -> None:
        """``flops``: the model FLOPs of one iteration of ``config.global_batch_size`` samples
        (``flops.model_flops_per_iteration``)."""
        self.config, self.world_size = config, world_size
        self.flops = flops
        self.peak = device_peak_tflops(device)
        keys = ("iterations", "losses", "loss_scales", "grad_norms", "lrs", "val_losses", "iter_ms")
        self.history: dict = {k: [] for k in keys}
        self.history.update(skipped=0, nan=0)
        self._pending: list[list] = []  # this interval's iterations, ROW values (device tensors)
        self._batch = config.global_batch_size  # this step's global batch (a ramp changes it)

    def due(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` prints the line (every --log-interval, and the last)."""
        return iteration % self.config.log_interval == 0 or iteration == self.config.train_iters

    def record(
        self,
        iteration: int,
        consumed: int,
        *,
        loss: DeviceScalar,
        grad_norm: DeviceScalar | None,
        skipped: DeviceScalar,
        nan: DeviceScalar,
        lr: float,
        loss_scale: float,
        iter_ms: float,
        step_ms: float | None = None,
        global_batch_size: int | None = None,
    ) -> Interval | None:
        """Add one iteration (``iter_ms``: the whole of it, data, step and logging; ``step_ms``:
        the step alone; its global batch, a ramp's, else the final); on a log iteration, read the
        interval and return it with its line. Nothing is read from the device otherwise."""
        self._batch = global_batch_size or self.config.global_batch_size
        row = [iteration, consumed, loss, grad_norm, skipped, nan, lr, loss_scale, iter_ms, step_ms,
               self._batch]  # fmt: skip
        self._pending.append(row)  # in ROW's order
        if not self.due(iteration):
            return None
        rows = self.flush()
        ms = [r["iter_ms"] for r in rows]
        losses = [r["loss"] for r in rows if not r["nan"]]  # a skipped fp16 step still has a true loss
        line = self._line(
            iteration, consumed, lr=lr, loss_scale=loss_scale, grad_norm=rows[-1]["grad_norm"],
            loss=sum(losses) / len(losses) if losses else float("nan"), iter_s=sum(ms) / len(ms) / 1000,
            skipped=sum(r["skipped"] for r in rows), nan=sum(r["nan"] for r in rows),
        )  # fmt: skip
        return Interval(line, rows)

    def flush(self) -> list[dict]:
        """Read the iterations recorded since the last read (one copy per device) into ``history``;
        return them as rows."""
        flat = to_host([v for row in self._pending for v in row])
        n = len(self.ROW)
        rows = [dict(zip(self.ROW, flat[i : i + n], strict=True)) for i in range(0, len(flat), n)]
        self._pending = []
        h = self.history
        for r in rows:
            r["skipped"], r["nan"] = bool(r["skipped"]), bool(r["nan"])
            for key, name in (
                ("iterations", "iteration"),
                ("losses", "loss"),
                ("loss_scales", "loss_scale"),
                ("grad_norms", "grad_norm"),
                ("lrs", "lr"),
                ("iter_ms", "iter_ms"),
            ):
                h[key].append(r[name])
            h["skipped"] += r["skipped"]
            h["nan"] += r["nan"]
        return rows

    def _line(
        self, iteration: int, consumed: int, *, lr: float, loss_scale: float, grad_norm: float | None,
        loss: float, iter_s: float, skipped: int, nan: int,
    ) -> str:  # fmt: skip
        a = self.config
        flops = self.flops * self._batch / a.global_batch_size  # the FLOPs scale with the batch
        tflops = flops / iter_s / self.world_size / 1e12
        return iteration_line(
            iteration=iteration,
            train_iters=a.train_iters,
            consumed_samples=consumed,
            elapsed_ms=1000 * iter_s,
            lr=lr,
            global_batch_size=self._batch,
            loss=loss,
            loss_scale=loss_scale,
            grad_norm=grad_norm,
            skipped=skipped,
            nan=nan,
            tokens_per_s=self._batch * a.seq_length / iter_s,
            tflops_per_device=tflops,
            mfu=tflops / self.peak if self.peak else None,
            throughput=tflops if a.log_throughput else None,
        )


class StepProfiler:
    """torch.profiler over iterations ``start+1 .. end`` (``--profile-step-start/end``, Megatron's
    meaning) of each rank in ``--profile-ranks`` (default: every rank), after a warm-up on iteration
    ``start``::

        schedule(wait=start - 1, warmup=1, active=end - start)      defaults 10, 12: traced 11 and 12

    counted in iterations, so that the trace's ``ProfilerStep#N`` is iteration N (also after
    ``--load``), with shapes, memory (allocations and frees: the Memory view's curve) and Python
    stacks. Rank r's trace lands in ``<tensorboard-dir>/<profile-name>/rank<r>.<time>.pt.trace.json``,
    the layout TensorBoard's PyTorch Profiler plugin reads (``tensorboard --logdir <tensorboard-dir>``),
    one worker per rank: ``--profile-ranks 0 2`` shows both stages of a TP=2 x PP=2 run.
    """

    def __init__(self, config: ProfilerConfig, rank: int, first_iteration: int = 1) -> None:
        self.folder = os.path.join(
            config.tensorboard_dir or os.path.join("runs", "tensorboard"), config.profile_name
        )
        self.prof = None
        # Megatron's --profile without --use-pytorch-profiler: nsys' capture range, CUDA only
        nsys = config.profile and not config.use_pytorch_profiler and torch.cuda.is_available()
        traces = not config.profile_ranks or rank in config.profile_ranks
        nsys = nsys and traces
        self.nsys_range = (config.profile_step_start, config.profile_step_end) if nsys else None
        self.iteration = first_iteration - 1  # iterations done
        if not config.profile_execution or not traces:
            return
        self.end = config.profile_step_end
        start = config.profile_step_start
        self.traced = (
            f"iterations {start + 1}-{self.end}" if self.end > start + 1 else f"iteration {self.end}"
        )
        if first_iteration > start:  # resumed (--load) past the warm-up
            print(
                f"> not profiling rank {rank}: this run starts at iteration {first_iteration}, after the "
                f"warm-up iteration {start}; set --profile-step-start {first_iteration} or later",
                flush=True,
            )
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=acts,
            # skip_first=1: the schedule is asked about iteration numbers, and there is no iteration 0
            schedule=torch.profiler.schedule(
                skip_first=1, wait=start - 1, warmup=1, active=self.end - start, repeat=1
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.folder, f"rank{rank}"),
            record_shapes=True,
            profile_memory=True,
            with_stack=True,
        )
        # torch counts profiler steps from 0; start the count at this run's first iteration instead
        self.prof.step_num = first_iteration
        self.prof.current_action = self.prof.schedule(first_iteration)
        self.prof.start()
        print(
            f"> profiling {self.traced} of rank {rank} (warm-up: iteration {start}) into {self.folder} "
            f"(TensorBoard PyTorch Profiler)",
            flush=True,
        )

    def step(self) -> None:
        """End of an iteration: the profiler moves to the next one; after ``end``, the trace is written.
        With ``--profile`` (nsys) on CUDA: cudaProfilerStart after iteration ``start``, Stop after ``end``."""
        self.iteration += 1
        if self.nsys_range is not None and self.iteration in self.nsys_range:
            cudart = torch.cuda.cudart()
            (cudart.cudaProfilerStart if self.iteration == self.nsys_range[0] else cudart.cudaProfilerStop)()
        if self.prof is None:
            return
        self.prof.step()
        if self.prof.step_num > self.end:
            self.stop()
            print(f"> profiler trace of {self.traced} written under {self.folder}", flush=True)

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
