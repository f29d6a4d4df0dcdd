"""The pretraining driver behind ``code/pretrain_gpt.py``: build everything once, then train.

    pretrain(argv)        parse and validate the arguments into the run's one Layout
                          (everything that can fail on bad input fails here, before a process
                          group or a tensor exists), start the process group, build_run
                          (``build.py``), train
    train(run)            the loop: Run.step, report_memory (after the first iteration: per rank,
                          and the estimator's predicted peak next to the measured one),
                          log_iteration, maybe_evaluate, maybe_save, stop_requested
                          (--exit-duration-in-mins, --exit-signal-handler: one MAX all-reduce);
                          --manual-gc and --empty-unused-memory-level (training/housekeeping.py);
                          then finish: final save, pipeline timeline, final validation and test

Logs follow Megatron: start-up lines from rank 0, iteration lines from the last rank (where the
loss lives with pipeline parallelism).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import flight_recorder, nccl_dumps
from distlab.distributed import discover, init_distributed, pick_backend, shutdown
from distlab.gpt.arguments import ArgumentError, parse_args, validate_args
from distlab.gpt.arguments.samples import evaluations_during_training
from distlab.gpt.build import Run, build_run
from distlab.gpt.checkpointing.checkpointing import Snapshot
from distlab.gpt.data.gpt_dataset import GPTDataset
from distlab.gpt.data.prefetch import Prefetcher
from distlab.gpt.interfaces import StepResult
from distlab.gpt.memory.memory_estimate import MemorySetup, estimate
from distlab.gpt.memory.meters import format_prediction, memory_report, out_of_memory_message
from distlab.gpt.native import torch_compile
from distlab.gpt.pipeline_parallel.p2p_communication import PipelineTransferError
from distlab.gpt.pipeline_parallel.timeline import bubble_summary, save_timeline
from distlab.gpt.planning.dry_run import check_dry_run_rank, dry_run
from distlab.gpt.training import housekeeping, log
from distlab.gpt.training.fault_handling import (
    HANG_GRACE_S,
    ExitSignal,
    is_hang,
    set_training_timeout,
    startup_timeout_s,
)
from distlab.gpt.training.straggler import StragglerDetector
from distlab.gpt.training.training import evaluate
from distlab.gpt.transformer.moe.moe_layer import take_stats
from distlab.log_line import LogLine
from distlab.rank_process import print_on

#: After the save on --exit-signal, rank 0: ``exiting program after receiving SIGUSR1 at iteration 7``.
EXIT_SIGNAL = LogLine("exiting program after receiving {signal} at iteration {iteration:d}")
#: Every surviving rank, after a collective timed out: ``> hang: a collective of iteration 8 waited
#: 6.0 s ...``; the ranks are those that wrote no flight record (``distlab.flight_recorder``).
HANG = LogLine(
    "> hang: a collective of iteration {iteration:d} waited {timeout_s:.1f} s "
    "(--distributed-timeout-minutes); no answer from ranks [{ranks}]"
)
#: After HANG's line and the report's: where the dumps are, and PyTorch's analyzer on them.
HANG_DUMPS = LogLine("> hang: flight records for PyTorch's analyzer (torchfrtrace FOLDER) in {folder}")
#: One MoE layer's routing in a logged iteration (all micro-batches and data-parallel ranks):
#: Megatron's load_balancing_loss (E sum_i f_i P_i, without its coefficient; 1 when balanced),
#: the (token, expert) pairs over capacity, and ``counts``: tokens per expert, space-separated.
MOE = LogLine(
    " [moe] iteration {it:d} | layer {layer:d} | load_balancing_loss: {aux:.6f} |"
    " dropped tokens: {dropped:d} | tokens per expert: {counts} |"
)


class OutOfMemory(RuntimeError):
    """The run did not fit: its message names the micro batch, the cap and the allocator's error."""


def pretrain(argv: list[str] | None = None) -> dict:
    """Run pretraining from a command line; return the history (losses per iteration, ...)."""
    args = parse_args(argv)
    try:
        if args.dry_run_world_size is not None:  # one rank of N, on the meta device: no process to launch
            check_dry_run_rank(args.dry_run_world_size, args.dry_run_rank)
        layout = validate_args(args, args.dry_run_world_size or discover().world_size)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    if args.dry_run_world_size is not None:
        found = dry_run(args, layout, args.dry_run_rank)
        print(*found.report(), sep="\n", flush=True)
        return {"dry_run": found}
    # before anything slow: SIGTERM's and SIGUSR1's default action would end a rank still starting
    exit_signal = ExitSignal(args.exit_signal).install() if args.exit_signal_handler else None
    flight_recorder.enable()  # before the first process group
    if pick_backend(args.distributed_backend) == "nccl":  # NCCL's watchdog dumps on a timeout
        nccl_dumps.arm(flight_recorder.dump_prefix(), flight_recorder.DEFAULT_BUFFER_SIZE)
    # until every rank is built, collectives wait at least STARTUP_TIMEOUT_S: a slow start is no hang
    ctx = init_distributed(
        args.distributed_backend, timeout_s=startup_timeout_s(args.distributed_timeout_minutes)
    )
    run, hosts = None, []
    try:
        run = build_run(args, layout, ctx)
        hosts = flight_recorder.start(flight_recorder.dump_prefix(), ctx.device)  # collective: all built
        set_training_timeout(run.state.groups(), args.distributed_timeout_minutes)
        return train(run, exit_signal)
    except torch.OutOfMemoryError as exc:  # CUDA's allocator (and --device-memory-gib's cap)
        raise OutOfMemory(out_of_memory_message(exc, args.micro_batch_size, args.device_memory_gib)) from None
    except RuntimeError as exc:
        waited_s = time.monotonic() - run.progress_at if run is not None else 0.0
        if run is not None and is_hang(exc, waited_s, 60 * args.distributed_timeout_minutes):
            report_hang(run, hosts, exc)  # a hang: name the ranks and the collective
        raise
    finally:
        if run is not None:  # else training never started: the collector was never stopped
            housekeeping.stop_manual_gc(run.housekeeping)
            run.backend.close()
        run = None  # unreachable now: shutdown() frees the run, then its groups' threads stop
        shutdown()
        if exit_signal is not None:
            exit_signal.release()


def train(run: Run, exit_signal: ExitSignal | None = None) -> dict:
    """The training loop, then :func:`finish`; returns the history. The next step's batches are
    read by a worker while a step runs (``data/prefetch.py``: the same batches, earlier)."""
    args = run.args
    timer = log.Timer(run.ctx.device)  # the one clock: iteration times and --exit-duration-in-mins
    first_iteration = run.iteration + 1  # of this run (after --load)
    profiler = log.StepProfiler(run.profiler, run.state.rank, first_iteration)
    print_on(run.rank0, "> training ...")
    run.model.train()
    iteration_ms = []  # this run's, for --torch-compile's line
    straggler = None
    if args.log_straggler:
        straggler = StragglerDetector(
            run.state.layout.world_size, run.state.rank, args.straggler_minmax_count,
            enabled=not args.disable_straggler_on_startup, port=args.straggler_ctrlr_port, device=run.ctx.device,
        )  # fmt: skip
    host = torch.device("cpu")
    prefetcher = Prefetcher(
        lambda first, m: run.batches(run.datasets[0], first, m, device=host), run.ctx.device
    )
    housekeeping.start_manual_gc(run.housekeeping)
    try:
        while run.iteration < args.train_iters:
            run.progress_at = time.monotonic()  # a collective that fails: how long it waited (is_hang)
            lr = run.lr_schedule.apply(run.optimizer, run.iteration + 1)
            batch = run.layout.global_batch_at(run.consumed)  # B (a ramp: this step's)
            batches = prefetcher.take(run.consumed, run.layout.micro_batches_at(run.consumed))
            following = run.consumed + batch
            if run.iteration + 1 < args.train_iters:  # read while this step runs
                prefetcher.prefetch(following, run.layout.micro_batches_at(following))
            # the previous iteration's logging, evaluation, save; data
            before_ms = 1000 * timer.lap(sync=False)
            result = run.step(batches)
            housekeeping.empty_unused_memory(run.housekeeping, run.ctx.device)
            # the device is waited for on log iterations only (the line's interval time is then whole)
            step_ms = 1000 * timer.lap(sync=run.tlog.due(run.iteration + 1))
            run.iteration += 1
            run.consumed += batch
            if run.iteration == first_iteration:
                report_memory(run)
            profiler.step()
            housekeeping.collect_after_step(run.housekeeping, run.iteration)
            log_iteration(run, result, lr, before_ms + step_ms, step_ms, batch)
            if straggler is not None:
                report_straggler(run, straggler, result, batch)
            iteration_ms.append(before_ms + step_ms)
            maybe_evaluate(run)
            maybe_save(run)
            if stop_requested(run, timer, exit_signal):
                break
    finally:
        prefetcher.close()
    profiler.stop()
    if straggler is not None:
        straggler.close()
    compiled = torch_compile.timing_line(iteration_ms) if args.torch_compile else None
    print_on(run.last_rank and compiled is not None, compiled)
    return finish(run)


def report_hang(run: Run, hosts: list[dict], exc: RuntimeError) -> None:
    """After a collective timed out, on every rank that is still running: dump this rank's flight
    record, wait up to ``HANG_GRACE_S`` for the other ranks' dumps, then print which ranks wrote
    none (:data:`HANG`), the collective they did not join and every rank's last one."""
    prefix, world = flight_recorder.dump_prefix(), run.state.layout.world_size
    waiting = flight_recorder.waiting_in(exc)  # gloo's record may lack it
    if isinstance(exc, PipelineTransferError):  # point-to-point: not in gloo's record at all
        members = sorted({run.state.rank, *exc.peers})
        waiting = dict(op=f"pipeline {exc.what}", group="pp", members=members, sizes=[list(exc.shape)])
    flight_recorder.dump(prefix, run.state.rank, hosts, waiting)
    dumps = flight_recorder.wait_for_dumps(prefix, world, HANG_GRACE_S)
    missing, lines = flight_recorder.hang_report(dumps, world, hosts)
    timeout_s = 60 * run.args.distributed_timeout_minutes
    line = HANG.format(iteration=run.iteration + 1, timeout_s=timeout_s, ranks=", ".join(map(str, missing)))
    folder = str(Path(prefix).parent)
    print_on(True, line, *lines, HANG_DUMPS.format(folder=folder))


def report_straggler(run: Run, straggler: StragglerDetector, result: StepResult, batch: int) -> None:
    """--log-straggler: this rank's forward-backward time; every --log-interval the min/max over the
    ranks (collective; rank 0 prints)."""
    straggler.record(result.forward_backward_ms)
    if run.iteration % run.args.log_interval == 0:
        flops = run.tlog.flops * batch / run.args.global_batch_size  # the FLOPs scale with the batch
        print_on(run.rank0, *straggler.report(run.iteration, flops))


def report_memory(run: Run) -> None:
    """Every rank's parameters, gradients, optimizer state and peak (collective; rank 0 prints),
    then rank 0's peak as ``memory_estimate`` predicts it and as its :class:`PeakMeter` measured it."""
    lines = memory_report(run.model, run.optimizer, run.ctx.device, run.state)
    setup = MemorySetup.from_run(run.args, run.layout, run.vocab_size, run.deepspeed_config)
    predicted = estimate(setup).peak(first_iteration=True, accumulating=run.layout.num_micro_batches > 1)
    line = format_prediction(predicted, *run.peak_meter.peak())
    run.peak_meter.stop()  # the first iteration was the measured one
    if (
        run.deepspeed_config is not None
    ):  # the estimate has ZeRO's shards, not DeepSpeed's flat buffers and buckets
        line += " (DeepSpeed's own buffers are not in the estimate)"
    print_on(run.rank0, *lines, line)


def log_iteration(
    run: Run, result: StepResult, lr: float, iter_ms: float, step_ms: float, batch: int
) -> None:
    """History, Megatron's line every --log-interval (last rank), TensorBoard scalars (each
    iteration's, written when its interval is read: the step's values stay on the device until then)."""
    loss_scale = run.scaler.scale if run.scaler else 1.0
    interval = run.tlog.record(
        run.iteration, run.consumed, loss=result.loss, lr=lr, loss_scale=loss_scale,
        grad_norm=result.grad_norm, skipped=result.skipped, nan=result.nan, iter_ms=iter_ms,
        step_ms=step_ms, global_batch_size=batch,
    )  # fmt: skip
    if run.args.num_experts is not None:
        log_moe(run, due=interval is not None)
    if interval is None:
        return
    print_on(run.last_rank, interval.line)
    for row in interval.rows:
        run.tensorboard.training(
            row["iteration"], row["consumed"], loss=row["loss"], lr=row["lr"], loss_scale=row["loss_scale"],
            grad_norm=row["grad_norm"], iter_ms=row["iter_ms"], timers={"train-step": row["step_ms"]},
            global_batch_size=row["batch"],
        )  # fmt: skip


def log_moe(run: Run, *, due: bool) -> None:
    """Each MoE layer's tokens per expert and load-balancing loss of this iteration, summed over
    the ranks holding other tokens and gathered over the stages (small collectives, on log
    iterations only), printed by the last rank and kept in the history; the counters restart
    every iteration."""
    layers = take_stats(run.model, run.state if due else None)
    if not due:
        return
    run.tlog.history.setdefault("moe", []).append({"iteration": run.iteration, "layers": layers})
    lines = [
        MOE.format(
            it=run.iteration, layer=s["layer"], aux=s["load_balancing_loss"], dropped=s["dropped"],
            counts=" ".join(map(str, s["tokens_per_expert"])),
        )
        for s in layers
    ]  # fmt: skip
    print_on(run.last_rank, *lines)


def maybe_evaluate(run: Run) -> None:
    """Validation every --eval-interval iterations, on the samples after the previous ones."""
    args, valid = run.args, run.datasets[1]
    if valid is None or not args.eval_iters or not args.eval_interval or run.iteration % args.eval_interval:
        return
    first = (run.iteration // args.eval_interval - 1) * args.eval_iters * args.global_batch_size
    run.tlog.history["val_losses"].append(validate(run, f"iteration {run.iteration}", valid, first))


def validate(run: Run, label: str, dataset: GPTDataset, first: int, to_tensorboard: bool = True) -> float:
    """Mean loss over --eval-iters global batches from sample ``first``; Megatron's box."""
    housekeeping.collect_around_validation(run.housekeeping)
    loss = evaluate(
        run.model,
        dataset,
        first,
        eval_iters=run.args.eval_iters,
        global_batch_size=run.args.global_batch_size,
        micro_batch_size=run.layout.micro_batch_size,
        num_micro_batches=run.layout.num_micro_batches,
        state=run.state,
        device=run.ctx.device,
        autocast=run.autocast,
        forward_backward_fn=run.forward_backward,
    )
    housekeeping.collect_around_validation(run.housekeeping)
    print_on(run.last_rank, *log.validation_lines(label, loss))
    if to_tensorboard:
        run.tensorboard.validation(run.iteration, run.consumed, loss)
    return loss


def maybe_save(run: Run) -> None:
    print_on(run.rank0, *run.checkpointer.poll())  # an --async-save that completed since
    if run.args.save and run.args.save_interval and run.iteration % run.args.save_interval == 0:
        save(run)


def save(run: Run) -> None:
    """Checkpoint the model, optimizer, scaler and RNG at this iteration (atomically)."""
    scaler_state = run.scaler.state_dict() if run.scaler else None
    lines = run.checkpointer.save(
        Snapshot(run.model, run.optimizer, scaler_state, run.iteration, run.consumed)
    )
    run.saved_at = run.iteration
    # checkpointer.SAVED, with blocking and total time (none while --async-save writes)
    print_on(run.rank0, *lines)


def stop_requested(run: Run, timer: log.Timer, exit_signal: ExitSignal | None) -> bool:
    """--exit-duration-in-mins (from the start of training) and --exit-signal-handler, decided by
    every rank together at the end of the iteration (one MAX all-reduce): a signal that reached one
    rank stops them all at the same iteration. On a signal: save now (with --save), then say so."""
    limit = run.args.exit_duration_in_mins
    if limit is None and exit_signal is None:
        return False
    minutes = timer.elapsed() / 60
    local = [limit is not None and minutes > limit, exit_signal is not None and exit_signal.received]
    flags = torch.tensor([float(f) for f in local], device=run.ctx.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    timed_out, signalled = (bool(f) for f in flags.tolist())
    if signalled:
        if run.args.save and run.saved_at != run.iteration:
            save(run)
        print_on(run.rank0, EXIT_SIGNAL.format(signal=exit_signal.name, iteration=run.iteration))
        return True
    print_on(
        run.rank0 and timed_out, f"exiting program after {minutes:.2f} minutes at iteration {run.iteration}"
    )
    return timed_out


def finish(run: Run) -> dict:
    """Final save, the pipeline timeline, final validation and test; the history."""
    args, history = run.args, run.tlog.history
    run.tlog.flush()  # a run stopped between two log lines: its last iterations into the history
    if args.save and run.saved_at != run.iteration:
        save(run)
    print_on(run.rank0, *run.checkpointer.wait())  # --async-save: the last write committed
    if run.timeline is not None and run.timeline.events:
        write_timeline(run)
    print_on(run.rank0, "[after training is done]")
    if run.iteration == args.train_iters and args.eval_iters:
        _, valid, test = run.datasets
        if valid is not None:
            first = evaluations_during_training(args) * args.eval_iters * args.global_batch_size
            history["final_val_loss"] = validate(run, "the end of training for val data", valid, first)
        if test is not None:
            label = "the end of training for test data"
            history["test_loss"] = validate(run, label, test, 0, to_tensorboard=False)
    run.tensorboard.close()
    history["args"] = dataclasses.asdict(args)
    history["iteration"] = run.iteration
    return history


def write_timeline(run: Run) -> None:
    """Gather the last step's F/B spans of every stage (collective per pipeline) and write them."""
    gathered = run.timeline.gather()
    s = run.state
    if s.tp_rank == 0 and s.cp_rank == 0 and s.dp_rank == 0 and s.is_first_stage:
        path = save_timeline({**gathered, "iteration": run.iteration}, run.args.pipeline_timeline)
        print_on(
            True,
            f"> pipeline timeline of iteration {run.iteration} written to {path}: {bubble_summary(gathered)}",
        )


__all__ = ["OutOfMemory", "pretrain", "train"]
