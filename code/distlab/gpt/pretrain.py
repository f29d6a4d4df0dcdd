"""The pretraining driver behind ``code/pretrain_gpt.py``: set up, train, evaluate, save.

Order of events (everything that can fail on bad input fails before the first tensor):

    parse + validate args  ->  process group, ParallelState, banner  ->  tokenizer, padded vocab
    ->  datasets  ->  model (+ DDP over the dp group)  ->  optimizer  ->  --load
    ->  loop: train_step, log every --log-interval, eval every --eval-interval,
              save every --save-interval, stop at --train-iters or --exit-duration-in-mins
    ->  final validation and test, final save

Logs follow Megatron: start-up lines from rank 0, iteration lines from the last rank (where the
loss lives with pipeline parallelism).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.distributed import cap_cpu_threads, discover, init_distributed
from distlab.gpt import checkpointing, log
from distlab.gpt import pipeline_parallel as pipe
from distlab.gpt.arguments import (
    ArgumentError,
    PretrainArgs,
    parse_args,
    parse_split,
    validate_args,
)
from distlab.gpt.gpt_dataset import build_datasets
from distlab.gpt.loss_scaler import DynamicLossScaler, autocast, describe_precision
from distlab.gpt.memory import memory_report
from distlab.gpt.model import GPTConfig, GPTModel
from distlab.gpt.optimizer import LRSchedule, build_optimizer
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pipeline_timeline import PipelineTimeline, bubble_summary, save_timeline
from distlab.gpt.pp_communications import P2PSpec, sync_tied_embedding_
from distlab.gpt.tensor_parallel import pad_vocab_size
from distlab.gpt.tokenizer import GPT2BPETokenizer
from distlab.gpt.training import evaluate, forward_backward, micro_batches, train_step

_START = time.time()


def _print(*lines: str, on: bool = True) -> None:
    if on:
        for line in lines:
            print(line, flush=True)


def pretrain(argv: list[str] | None = None) -> dict:
    """Run pretraining from a command line; return the history (losses per iteration, ...)."""
    args = parse_args(argv)
    try:
        validate_args(args, discover().world_size)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    ctx = init_distributed(args.distributed_backend, timeout_s=60 * args.distributed_timeout_minutes)
    try:
        return _pretrain(args, ctx)
    finally:
        dist.destroy_process_group()


def _pretrain(args: PretrainArgs, ctx) -> dict:
    state = ParallelState.build(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size)
    rank0, last = state.rank == 0, state.rank == ctx.world_size - 1
    device = ctx.device
    threads = cap_cpu_threads(ctx.env.local_world_size) if device.type == "cpu" else "device: " + str(device)
    accum = state.dims.validate_batch(
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size
    )
    _print(
        state.banner(),
        f"> launcher: {ctx.env.launcher}, backend: {ctx.backend}, {threads}",
        describe_precision(args, device),
        on=rank0,
    )
    _print(
        f"> global batch size {args.global_batch_size} = micro batch {args.micro_batch_size} x data-parallel "
        f"{state.dp} x accumulation steps {accum}",
        on=rank0,
    )
    tokenizer = GPT2BPETokenizer(args.vocab_file, args.merge_file)
    vocab = pad_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, state.tp)
    _print(
        f"> padded vocab (size: {tokenizer.vocab_size}) with {vocab - tokenizer.vocab_size} dummy tokens "
        f"(new size: {vocab})",
        on=rank0,
    )

    n_evals = args.train_iters // args.eval_interval + 1
    gbs = args.global_batch_size
    wanted = [args.train_iters * gbs, n_evals * args.eval_iters * gbs, args.eval_iters * gbs]
    train_ds, valid_ds, test_ds = build_datasets(
        args.data_path, parse_split(args.split), args.seq_length, wanted, args.seed
    )
    _print(
        f"> datasets from {args.data_path}: "
        + ", ".join(
            f"{d.name} {len(d)} samples ({d.num_epochs} epoch(s))" for d in (train_ds, valid_ds, test_ds) if d
        ),
        on=rank0,
    )

    torch.manual_seed(args.seed + 100 * state.pp_rank)
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
    module = GPTModel(cfg, state).to(device)
    n_params = sum(p.numel() for p in module.parameters())
    _print(
        f" > number of parameters on (tensor, pipeline) model parallel rank ({state.tp_rank}, {state.pp_rank}): "
        f"{n_params}",
        on=state.dp_rank == 0,
    )
    model = module
    if state.dp > 1:
        model = DDP(
            module, process_group=state.dp_group, device_ids=[device.index] if device.type == "cuda" else None
        )
    optimizer = build_optimizer(module, args)
    schedule = LRSchedule(args)
    scaler = (
        DynamicLossScaler(
            args.initial_loss_scale, args.min_loss_scale, args.loss_scale_window, args.hysteresis
        )
        if args.fp16
        else None
    )

    iteration, consumed = 0, 0
    if args.load:
        loaded = checkpointing.load_checkpoint(args, state, module, optimizer)
        if loaded is None:
            _print(f"> no checkpoint in {args.load}: starting from scratch", on=rank0)
        else:
            iteration, consumed, scaler_state = loaded
            if scaler is not None and scaler_state is not None:
                scaler.load_state_dict(scaler_state)
            _print(f"> loaded checkpoint from {args.load} at iteration {iteration}", on=rank0)

    tb = log.TensorBoardLog(args, enabled=last)
    tlog = log.TrainingLog(args, vocab_size=vocab, world_size=ctx.world_size, device=device)
    history = tlog.history
    amp = lambda: autocast(args, device)  # noqa: E731
    fwd_bwd, timeline = forward_backward, None  # pp == 1: a loop over micro-batches (training.py)
    first_iteration = iteration + 1  # of this run (after --load): the memory report follows it
    if state.pp > 1:  # the stages run GPipe or 1F1B (pipeline_parallel.py); the loss lives on the last
        ends = state.is_first_stage or state.is_last_stage  # the stages holding the tied embedding
        sync_tied_embedding_(module.output_embedding() if ends else None, state)
        if args.pipeline_timeline:
            timeline = PipelineTimeline(state.pp_rank, state.pp, device, group=state.pp_group)
        spec = P2PSpec((args.micro_batch_size, args.seq_length, args.hidden_size), torch.float32, device,
                            timeout_s=60 * args.distributed_timeout_minutes)  # fmt: skip
        fwd_bwd = pipe.make_forward_backward(state, spec, schedule=args.pipeline_schedule, timeline=timeline)
        _print(pipe.describe(args.pipeline_schedule, state.pp, accum), on=rank0)
    step_timer = log.Timer(device)
    prof = log.StepProfiler(args, state.rank)
    _print("> training ...", on=rank0)
    model.train()
    saved_at = None

    def save(it: int) -> None:
        nonlocal saved_at
        checkpointing.save_checkpoint(
            args, state, module, optimizer, scaler.state_dict() if scaler else None, it, consumed
        )
        saved_at = it
        _print(f"  successfully saved checkpoint at iteration {it:7d} to {args.save}", on=rank0)

    def validate(label: str, dataset, first: int, to_tensorboard: bool = True) -> float:
        loss = evaluate(
            model,
            dataset,
            first,
            eval_iters=args.eval_iters,
            global_batch_size=gbs,
            micro_batch_size=args.micro_batch_size,
            num_micro_batches=accum,
            state=state,
            device=device,
            autocast=amp,
            forward_backward_fn=fwd_bwd,
        )
        _print(*log.validation_lines(label, loss), on=last)
        if to_tensorboard:
            tb.validation(iteration, consumed, loss)
        return loss

    while iteration < args.train_iters:
        lr = schedule.apply(optimizer, iteration + 1)
        batches = micro_batches(
            train_ds,
            consumed,
            micro_batch_size=args.micro_batch_size,
            num_micro_batches=accum,
            dp=state.dp,
            dp_rank=state.dp_rank,
            device=device,
        )
        step_timer.start()
        result = train_step(model, optimizer, batches, state=state, clip_grad=args.clip_grad, scaler=scaler,
                            autocast=amp, forward_backward_fn=fwd_bwd)  # fmt: skip
        step_ms = 1000 * step_timer.stop()
        iteration += 1
        consumed += gbs
        if iteration == first_iteration:  # collective: every rank's memory, printed by rank 0
            _print(*memory_report(module, optimizer, device, state), on=rank0)
        prof.step()
        loss_scale = scaler.scale if scaler else 1.0
        line = tlog.record(iteration, consumed, loss=result.loss, grad_norm=result.grad_norm, skipped=result.skipped,
                           nan=result.nan, lr=lr, loss_scale=loss_scale)  # fmt: skip
        _print(line, on=last and line is not None)
        tb.training(iteration, consumed, loss=result.loss, lr=lr, loss_scale=loss_scale, grad_norm=result.grad_norm,
                    iter_ms=step_ms, timers={"train-step": step_ms})  # fmt: skip
        if valid_ds is not None and args.eval_iters and iteration % args.eval_interval == 0:
            first = (iteration // args.eval_interval - 1) * args.eval_iters * gbs
            history["val_losses"].append(validate(f"iteration {iteration}", valid_ds, first))
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save(iteration)
        if args.exit_duration_in_mins is not None:
            done = torch.tensor(float(time.time() - _START > 60 * args.exit_duration_in_mins), device=device)
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                _print(
                    f"exiting program after {(time.time() - _START) / 60:.2f} minutes at iteration {iteration}",
                    on=rank0,
                )
                break
    prof.stop()
    if args.save and saved_at != iteration:
        save(iteration)
    if timeline is not None and timeline.events:  # collective over each pipeline group
        gathered = timeline.gather()
        if state.tp_rank == 0 and state.dp_rank == 0 and state.is_first_stage:
            path = save_timeline({**gathered, "iteration": iteration}, args.pipeline_timeline)
            _print(
                f"> pipeline timeline of iteration {iteration} written to {path}: {bubble_summary(gathered)}"
            )
    _print("[after training is done]", on=rank0)
    if iteration == args.train_iters and args.eval_iters:
        final = args.train_iters // args.eval_interval
        if valid_ds is not None:
            history["final_val_loss"] = validate(
                "the end of training for val data", valid_ds, final * args.eval_iters * gbs
            )
        if test_ds is not None:
            history["test_loss"] = validate(
                "the end of training for test data", test_ds, 0, to_tensorboard=False
            )
    tb.close()
    history["args"] = dataclasses.asdict(args)
    history["iteration"] = iteration
    return history


__all__ = ["pretrain"]
