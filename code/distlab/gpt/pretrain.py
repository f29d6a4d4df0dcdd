"""The pretraining driver behind ``code/pretrain_gpt.py``: build everything once, then train.

    pretrain(argv)        parse and validate the arguments (everything that can fail on bad
                          input fails here, before a process group or a tensor exists), start
                          the process group, build_run, train
    build_run(args, ctx)  layout and banner, tokenizer and padded vocabulary, datasets, model,
                          optimizer, loss scaler, LR schedule, forward/backward, --load: a Run
    train(run)            the loop: train_step, log, maybe_evaluate, maybe_save, time_exceeded;
                          then finish: final save, pipeline timeline, final validation and test

Logs follow Megatron: start-up lines from rank 0, iteration lines from the last rank (where the
loss lives with pipeline parallelism).

Where a new path slots in: ``Run.step`` turns one global batch into a ``StepResult``
(forward/backward, gradient finalisation, optimizer step; :func:`optimizer_step` by default),
so an engine that owns the optimizer and the gradients replaces that one field in
:func:`build_run`; :func:`report_memory` runs once, after the first iteration; the profiler is
built when training starts and stepped after every iteration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.distributed import DistContext, cap_cpu_threads, discover, init_distributed, print_on
from distlab.gpt import checkpointing, log
from distlab.gpt.arguments import ArgumentError, PretrainArgs, parse_args, parse_split, validate_args
from distlab.gpt.gpt_dataset import GPTDataset, build_datasets
from distlab.gpt.loss_scaler import DynamicLossScaler, autocast, describe_precision
from distlab.gpt.memory import memory_report
from distlab.gpt.model import GPTConfig, GPTModel
from distlab.gpt.optimizer import LRSchedule, build_optimizer
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pipeline_parallel import PipelineForwardBackward, describe
from distlab.gpt.pipeline_timeline import PipelineTimeline, bubble_summary, save_timeline
from distlab.gpt.pp_communications import P2PSpec
from distlab.gpt.profiler import StepProfiler
from distlab.gpt.tensor_parallel import pad_vocab_size, vocab_padding_message
from distlab.gpt.tokenizer import GPT2BPETokenizer
from distlab.gpt.training import StepResult, evaluate, forward_backward, micro_batches, train_step


def pretrain(argv: list[str] | None = None) -> dict:
    """Run pretraining from a command line; return the history (losses per iteration, ...)."""
    args = parse_args(argv)
    try:
        validate_args(args, discover().world_size)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    ctx = init_distributed(args.distributed_backend, timeout_s=60 * args.distributed_timeout_minutes)
    try:
        return train(build_run(args, ctx))
    finally:
        dist.destroy_process_group()


def optimizer_step(run: Run, batches: list) -> StepResult:
    """One global batch: forward/backward, gradient finalisation, optimizer step (``Run.step``)."""
    return train_step(
        run.model,
        run.optimizer,
        batches,
        state=run.state,
        clip_grad=run.args.clip_grad,
        scaler=run.scaler,
        autocast=run.autocast,
        forward_backward_fn=run.forward_backward,
    )


@dataclass
class Run:
    """Everything one training run holds, built once by :func:`build_run`."""

    args: PretrainArgs
    ctx: DistContext
    state: ParallelState
    num_micro_batches: int  # m = global batch / (micro batch x dp), checked by validate_args
    vocab_size: int  # V, padded
    datasets: list[GPTDataset | None]  # train, validation, test
    model: GPTModel
    optimizer: torch.optim.Optimizer
    scaler: DynamicLossScaler | None
    lr_schedule: LRSchedule
    forward_backward: Callable[..., torch.Tensor]  # training.forward_backward or the pipeline's
    timeline: PipelineTimeline | None
    tlog: log.TrainingLog
    tensorboard: log.TensorBoardLog
    step: Callable[[Run, list], StepResult] = optimizer_step  # one global batch -> StepResult
    iteration: int = 0
    consumed: int = 0  # samples
    saved_at: int | None = None

    @property
    def rank0(self) -> bool:
        return self.state.rank == 0

    @property
    def last_rank(self) -> bool:
        """The rank that prints the loss (the last stage of the last pipeline)."""
        return self.state.rank == self.ctx.world_size - 1

    def autocast(self):
        return autocast(self.args, self.ctx.device)

    def batches(self, dataset: GPTDataset, first_sample: int) -> list:
        return micro_batches(
            dataset,
            first_sample,
            micro_batch_size=self.args.micro_batch_size,
            num_micro_batches=self.num_micro_batches,
            state=self.state,
            device=self.ctx.device,
        )


def build_run(args: PretrainArgs, ctx: DistContext) -> Run:
    """Layout, data, model, optimizer and schedule, printing Megatron's start-up lines."""
    state = ParallelState.build(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size)
    m = args.global_batch_size // (args.micro_batch_size * state.dp)
    rank0, device = state.rank == 0, ctx.device
    threads = cap_cpu_threads(ctx.env.local_world_size) if device.type == "cpu" else f"device: {device}"
    print_on(
        rank0,
        state.banner(),
        f"> launcher: {ctx.env.launcher}, backend: {ctx.backend}, {threads}",
        describe_precision(args, device),
        f"> global batch size {args.global_batch_size} = micro batch {args.micro_batch_size} x "
        f"data-parallel {state.dp} x accumulation steps {m}",
    )
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
    vocab = pad_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, state.tp)
    print_on(rank0, vocab_padding_message(tokenizer.vocab_size, vocab))
    datasets = _build_datasets(args, rank0)
    model = _build_model(args, state, vocab, device)
    timeline = None
    if args.pipeline_timeline:
        timeline = PipelineTimeline(state.pp_rank, state.pp, device, group=state.pp_group)
    run = Run(
        args=args,
        ctx=ctx,
        state=state,
        num_micro_batches=m,
        vocab_size=vocab,
        datasets=datasets,
        model=model,
        optimizer=build_optimizer(model, args),
        scaler=_build_scaler(args),
        lr_schedule=LRSchedule(args),
        forward_backward=_build_forward_backward(args, state, device, timeline),
        timeline=timeline,
        tlog=log.TrainingLog(args, vocab_size=vocab, world_size=ctx.world_size, device=device),
        tensorboard=log.TensorBoardLog(args, enabled=state.rank == ctx.world_size - 1),
    )
    if args.load:
        load(run)
    if state.pp > 1:
        print_on(rank0, describe(args.pipeline_schedule, state.pp, m))
    return run


def _build_datasets(args: PretrainArgs, rank0: bool) -> list[GPTDataset | None]:
    """Train, validation and test samples for every iteration and evaluation of the run."""
    B = args.global_batch_size
    n_evals = args.train_iters // args.eval_interval + 1
    wanted = [args.train_iters * B, n_evals * args.eval_iters * B, args.eval_iters * B]
    datasets = build_datasets(args.data_path, parse_split(args.split), args.seq_length, wanted, args.seed)
    sizes = ", ".join(f"{d.name} {len(d)} samples ({d.num_epochs} epoch(s))" for d in datasets if d)
    print_on(rank0, f"> datasets from {args.data_path}: {sizes}")
    return datasets


def _build_model(args: PretrainArgs, state: ParallelState, vocab: int, device: torch.device) -> GPTModel:
    """This rank's stage and tensor-parallel shard of the GPT; prints its parameter count."""
    torch.manual_seed(args.seed + 100 * state.pp_rank)  # dropout; the weights come from init_parameters
    cfg = GPTConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        vocab_size=vocab,
        max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        recompute_activations=args.recompute_activations,
        seed=args.seed,
    )
    model = GPTModel(cfg, state).to(device)
    print_on(
        state.dp_rank == 0,
        f" > number of parameters on (tensor, pipeline) model parallel rank ({state.tp_rank}, "
        f"{state.pp_rank}): {sum(p.numel() for p in model.parameters())}",
    )
    return model


def _build_scaler(args: PretrainArgs) -> DynamicLossScaler | None:
    if not args.fp16:
        return None
    return DynamicLossScaler(
        args.initial_loss_scale, args.min_loss_scale, args.loss_scale_window, args.hysteresis
    )


def _build_forward_backward(
    args: PretrainArgs, state: ParallelState, device: torch.device, timeline: PipelineTimeline | None
) -> Callable[..., torch.Tensor]:
    """pp = 1: a loop over the micro-batches; pp > 1: the GPipe or 1F1B schedule."""
    if state.pp == 1:
        return forward_backward
    shape = (args.micro_batch_size, args.seq_length, args.hidden_size)  # (b, T, H) between stages
    spec = P2PSpec(shape, torch.float32, device, timeout_s=60 * args.distributed_timeout_minutes)
    return PipelineForwardBackward(state, spec, schedule=args.pipeline_schedule, timeline=timeline)


def load(run: Run) -> None:
    """Resume from ``--load`` (model, optimizer, scaler, RNG, iteration, consumed samples)."""
    loaded = checkpointing.load_checkpoint(run.args, run.state, run.model, run.optimizer)
    if loaded is None:
        print_on(run.rank0, f"> no checkpoint in {run.args.load}: starting from scratch")
        return
    run.iteration, run.consumed, scaler_state = loaded
    if run.scaler is not None and scaler_state is not None:
        run.scaler.load_state_dict(scaler_state)
    print_on(run.rank0, f"> loaded checkpoint from {run.args.load} at iteration {run.iteration}")


def train(run: Run) -> dict:
    """The training loop, then :func:`finish`; returns the history."""
    args = run.args
    timer = log.Timer(run.ctx.device)  # the one clock: iteration times and --exit-duration-in-mins
    profiler = StepProfiler(args, run.state.rank)
    first_iteration = run.iteration + 1  # of this run (after --load)
    print_on(run.rank0, "> training ...")
    run.model.train()
    while run.iteration < args.train_iters:
        lr = run.lr_schedule.apply(run.optimizer, run.iteration + 1)
        result = run.step(run, run.batches(run.datasets[0], run.consumed))
        run.iteration += 1
        run.consumed += args.global_batch_size
        iter_ms = 1000 * timer.lap()
        if run.iteration == first_iteration:
            report_memory(run)
        profiler.step()
        log_iteration(run, result, lr, iter_ms)
        maybe_evaluate(run)
        maybe_save(run)
        if time_exceeded(run, timer):
            break
    profiler.stop()
    return finish(run)


def report_memory(run: Run) -> None:
    """Every rank's parameters, gradients, optimizer state and peak (collective; rank 0 prints)."""
    print_on(run.rank0, *memory_report(run.model, run.optimizer, run.ctx.device, run.state))


def log_iteration(run: Run, result: StepResult, lr: float, iter_ms: float) -> None:
    """History, Megatron's line every --log-interval (last rank), TensorBoard scalars."""
    loss_scale = run.scaler.scale if run.scaler else 1.0
    fields = dict(loss=result.loss, lr=lr, loss_scale=loss_scale, grad_norm=result.grad_norm)
    line = run.tlog.record(
        run.iteration, run.consumed, **fields, skipped=result.skipped, nan=result.nan, iter_ms=iter_ms
    )
    print_on(run.last_rank and line is not None, line)
    run.tensorboard.training(run.iteration, run.consumed, **fields, iter_ms=iter_ms)


def maybe_evaluate(run: Run) -> None:
    """Validation every --eval-interval iterations, on the samples after the previous ones."""
    args, valid = run.args, run.datasets[1]
    if valid is None or not args.eval_iters or run.iteration % args.eval_interval:
        return
    first = (run.iteration // args.eval_interval - 1) * args.eval_iters * args.global_batch_size
    run.tlog.history["val_losses"].append(validate(run, f"iteration {run.iteration}", valid, first))


def validate(run: Run, label: str, dataset: GPTDataset, first: int, to_tensorboard: bool = True) -> float:
    """Mean loss over --eval-iters global batches from sample ``first``; Megatron's box."""
    loss = evaluate(
        run.model,
        dataset,
        first,
        eval_iters=run.args.eval_iters,
        global_batch_size=run.args.global_batch_size,
        micro_batch_size=run.args.micro_batch_size,
        num_micro_batches=run.num_micro_batches,
        state=run.state,
        device=run.ctx.device,
        autocast=run.autocast,
        forward_backward_fn=run.forward_backward,
    )
    print_on(run.last_rank, *log.validation_lines(label, loss))
    if to_tensorboard:
        run.tensorboard.validation(run.iteration, run.consumed, loss)
    return loss


def maybe_save(run: Run) -> None:
    if run.args.save and run.args.save_interval and run.iteration % run.args.save_interval == 0:
        save(run)


def save(run: Run) -> None:
    """Checkpoint the model, optimizer, scaler and RNG at this iteration (atomically)."""
    scaler_state = run.scaler.state_dict() if run.scaler else None
    checkpointing.save_checkpoint(
        run.args, run.state, run.model, run.optimizer, scaler_state, run.iteration, run.consumed
    )
    run.saved_at = run.iteration
    print_on(run.rank0, f"  successfully saved checkpoint at iteration {run.iteration:7d} to {run.args.save}")


def time_exceeded(run: Run, timer: log.Timer) -> bool:
    """--exit-duration-in-mins, measured from the start of training; every rank agrees (MAX)."""
    if run.args.exit_duration_in_mins is None:
        return False
    minutes = timer.elapsed() / 60
    flag = torch.tensor(float(minutes > run.args.exit_duration_in_mins), device=run.ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    done = bool(flag.item())
    print_on(run.rank0 and done, f"exiting program after {minutes:.2f} minutes at iteration {run.iteration}")
    return done


def finish(run: Run) -> dict:
    """Final save, the pipeline timeline, final validation and test; the history."""
    args, history = run.args, run.tlog.history
    if args.save and run.saved_at != run.iteration:
        save(run)
    if run.timeline is not None and run.timeline.events:
        write_timeline(run)
    print_on(run.rank0, "[after training is done]")
    if run.iteration == args.train_iters and args.eval_iters:
        _, valid, test = run.datasets
        if valid is not None:
            first = args.train_iters // args.eval_interval * args.eval_iters * args.global_batch_size
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
    if s.tp_rank == 0 and s.dp_rank == 0 and s.is_first_stage:
        path = save_timeline({**gathered, "iteration": run.iteration}, run.args.pipeline_timeline)
        print_on(
            True,
            f"> pipeline timeline of iteration {run.iteration} written to {path}: {bubble_summary(gathered)}",
        )


__all__ = ["Run", "build_run", "pretrain", "train"]
