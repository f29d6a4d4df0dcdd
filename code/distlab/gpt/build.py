"""Everything a training run holds, built once: :class:`Run` and :func:`build_run`.

    build_run(args, layout, ctx)   process groups of the validated layout and the banner,
                                   tokenizer and padded vocabulary, datasets, memory cap and
                                   meter, model (DTensor TP: parallelize_module; FSDP2:
                                   fully_shard; both before the optimizer is built on the
                                   shards), optimizer, precision and loss scaler, LR schedule,
                                   forward/backward, the step back end, --load

The layers below take typed configs, never the arguments: ``build_run`` maps them once
(``arguments/to_configs.py``) and hands each its own.

Start-up lines follow Megatron's, printed by rank 0 (the parameter count by every
data-parallel rank 0: one line per model shard). :meth:`Run.step` is the one function that
turns a global batch into a ``StepResult``: ``training.train_step`` through the run's back end,
this engine's own (``training.LocalBackend``), with ``--deepspeed`` DeepSpeed's engine
(``deepspeed_engine.DeepSpeedBackend``: ZeRO shards the gradients and wraps the run's own
optimizer, whose learning rate the schedule still sets) or, with ``--use-torch-fsdp2``,
PyTorch's FSDP2 (``fsdp2.FSDP2Backend``: ``fully_shard`` turns the parameters into DTensor shards
before the run's own optimizer is built on them). ``--tensor-parallel-impl dtensor`` builds the
model whole and splits it with ``dtensor_parallel``'s plan on the run's one ``DeviceMesh`` (before
FSDP2 when both are given), stepping through the same back end.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh

from distlab.distributed import DistContext
from distlab.gpt.arguments import PretrainArgs, deepspeed_run_config, parse_split
from distlab.gpt.arguments.implementations import implementation_lines
from distlab.gpt.arguments.samples import evaluations_during_training
from distlab.gpt.arguments.to_configs import (
    checkpoint_config,
    ddp_config,
    flops_config,
    housekeeping_config,
    logging_config,
    lr_schedule,
    model_config,
    moe_config,
    optimizer_config,
    precision_config,
    profiler_config,
)
from distlab.gpt.checkpointing import checkpointer, checkpointing
from distlab.gpt.context_parallel.ring_attention import describe as describe_cp
from distlab.gpt.context_parallel.ring_attention import ring_of
from distlab.gpt.data.gpt_dataset import GPTDataset, build_datasets
from distlab.gpt.data.indexed_dataset import IndexedDataset
from distlab.gpt.data.mock_dataset import MockIndexedDataset
from distlab.gpt.data.tokenizers import TokenizerSpec
from distlab.gpt.deepspeed import config as deepspeed_config
from distlab.gpt.deepspeed import engine as deepspeed_engine
from distlab.gpt.interfaces import MicroBatch, StepBackend, StepResult
from distlab.gpt.layout import Layout
from distlab.gpt.memory.meters import PeakMeter, cap_device_memory
from distlab.gpt.native import torch_compile
from distlab.gpt.optimizer.distrib_optimizer import build_distributed_optimizer, distributed_optimizer_line
from distlab.gpt.optimizer.loss_scaler import DynamicLossScaler
from distlab.gpt.optimizer.optimizer import build_optimizer
from distlab.gpt.optimizer.optimizer_config import OptimizerConfig
from distlab.gpt.optimizer.optimizer_param_scheduler import LRSchedule
from distlab.gpt.optimizer.precision import Precision
from distlab.gpt.parallel_state import ParallelState
from distlab.gpt.pipeline_parallel.p2p_communication import P2PSpec
from distlab.gpt.pipeline_parallel.schedules import PipelineForwardBackward, describe
from distlab.gpt.pipeline_parallel.timeline import PipelineTimeline
from distlab.gpt.tensor_parallel.layers import pad_vocab_size, vocab_padding_message
from distlab.gpt.tensor_parallel.rng_tracker import model_parallel_manual_seed
from distlab.gpt.training import housekeeping, log
from distlab.gpt.training.fault_handling import startup_timeout_s
from distlab.gpt.training.flops import flops_line, model_flops_per_iteration
from distlab.gpt.training.training import LocalBackend, forward_backward, micro_batches, train_step
from distlab.gpt.transformer.config import GPTConfig
from distlab.gpt.transformer.gpt_model import GPTModel
from distlab.log_line import LogLine
from distlab.rank_process import cap_cpu_threads, network_settings, print_on

#: Start-up lines of rank 0: the batch arithmetic, then each (tp, pp) rank's parameter count.
BATCH = LogLine(
    "> global batch size {global_batch:d} = micro batch {micro_batch:d} x data-parallel {dp:d} "
    "x accumulation steps {accumulation:d}"
)
PARAMETERS = LogLine(
    " > number of parameters on (tensor, pipeline) model parallel rank ({tp_rank:d}, {pp_rank:d}): "
    "{parameters:d}"
)


@dataclass
class Run:
    """Everything one training run holds, built once by :func:`build_run`."""

    args: PretrainArgs
    layout: Layout  # sizes and batch arithmetic, validated once by validate_args
    ctx: DistContext
    state: ParallelState
    precision: Precision
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
    peak_meter: PeakMeter  # started just before the model was built
    backend: StepBackend  # LocalBackend, DeepSpeed's engine (--deepspeed) or FSDP2Backend
    checkpointer: checkpointer.Checkpointer  # --save in --ckpt-format's format (--async-save)
    housekeeping: housekeeping.HousekeepingConfig  # --manual-gc, --empty-unused-memory-level
    profiler: log.ProfilerConfig  # what the training loop traces
    deepspeed_config: dict | None = None
    iteration: int = 0
    consumed: int = 0  # samples
    saved_at: int | None = None
    progress_at: float = field(default_factory=time.monotonic)  # when this iteration (or the run) began

    @property
    def rank0(self) -> bool:
        return self.state.rank == 0

    @property
    def last_rank(self) -> bool:
        """The rank that prints the loss (the last stage of the last pipeline)."""
        return self.state.rank == self.ctx.world_size - 1

    def autocast(self):
        if self.args.use_torch_fsdp2:  # FSDP2's MixedPrecisionPolicy casts the parameters instead
            return contextlib.nullcontext()
        return self.precision.autocast(self.ctx.device)

    def step(self, batches: list[MicroBatch]) -> StepResult:
        """One global batch: forward/backward, gradient reduction, optimizer step."""
        return train_step(
            self.backend,
            batches,
            state=self.state,
            autocast=self.autocast,
            forward_backward_fn=self.forward_backward,
            time_forward_backward=self.args.log_straggler,  # its min/max over the ranks
        )

    def batches(
        self,
        dataset: GPTDataset,
        first_sample: int,
        num_micro_batches: int,
        device: torch.device | None = None,
    ) -> list[MicroBatch]:
        """This rank's micro-batches of the global batch from ``first_sample``, on ``device``
        (default: the run's)."""
        return micro_batches(
            dataset,
            first_sample,
            micro_batch_size=self.layout.micro_batch_size,
            num_micro_batches=num_micro_batches,
            state=self.state,
            device=device or self.ctx.device,
        )


def build_run(args: PretrainArgs, layout: Layout, ctx: DistContext) -> Run:
    """Groups, data, model, optimizer and schedule, printing Megatron's start-up lines."""
    # groups built for the start; pretrain() sets --distributed-timeout-minutes once every rank is built
    state = ParallelState.build(layout, timeout_s=startup_timeout_s(args.distributed_timeout_minutes))
    precision = precision_config(args)
    # torch.distributed.fsdp only for runs that use it: imported, it changes DeepSpeed
    # (checkpointing/checkpointer.py)
    mesh_run = args.use_torch_fsdp2 or (args.tensor_parallel_impl == "dtensor" and layout.tp > 1)
    fsdp2 = importlib.import_module("distlab.gpt.native.fsdp2") if mesh_run else None
    rank0, device = state.rank == 0, ctx.device
    threads = cap_cpu_threads(ctx.env.local_world_size) if device.type == "cpu" else f"device: {device}"
    print_on(
        rank0,
        state.banner(),
        f"> launcher: {ctx.env.launcher}, backend: {ctx.backend}, {threads}",
        fsdp2.precision_line(precision, device) if args.use_torch_fsdp2 else precision.describe(device),
        BATCH.format(
            global_batch=layout.global_batch_size,
            micro_batch=layout.micro_batch_size,
            dp=layout.dp,
            accumulation=layout.num_micro_batches,
        ),
    )
    network = network_settings()  # every rank: shows which nodes got the job's (or .deepspeed_env's) settings
    print_on(network is not None, f"> rank {ctx.rank} on {socket.gethostname()}: {network}")
    if layout.batch_schedule:
        print_on(rank0, ramp_line(layout))
    moe = moe_config(args)
    print_on(rank0 and moe is not None, moe and moe.describe(layout.ep, layout.tp))
    if state.cp > 1:
        print_on(rank0, describe_cp(args.seq_length, ring_of(state)))
    spec = TokenizerSpec.from_args(args)
    tokenizer = spec.build()
    vocab = pad_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, state.tp)
    flops = flops_config(args, vocab)
    print_on(rank0, spec.describe(tokenizer), vocab_padding_message(tokenizer.vocab_size, vocab),
             flops_line(flops), *implementation_lines(args, cuda=device.type == "cuda"))  # fmt: skip
    datasets = _build_datasets(args, tokenizer, rank0)
    cap = cap_device_memory(args.device_memory_gib, device)
    print_on(rank0 and cap is not None, cap)
    if args.deepspeed:
        importlib.import_module("deepspeed")  # importing it allocates: before the meter's baseline
    optim, ddp = optimizer_config(args), ddp_config(args)
    if device.type == "cpu":
        _warm_up_kernels(flops.model, optim, precision)
    peak_meter = PeakMeter(device).start()
    model = build_model(args, state, vocab, device)
    mesh = parallelize_model(args, state, model, device)
    if optim.use_distributed_optimizer:  # Megatron's: parameters in the run's dtype, fp32 main shards
        optimizer = build_distributed_optimizer(model, state, optim, ddp, precision.dtype)
        print_on(rank0, distributed_optimizer_line(optimizer, precision.dtype))
    else:
        optimizer = build_optimizer(model, optim)  # on the shards with FSDP2
    scaler = precision.loss_scaler()
    timeline, log_config = None, logging_config(args)
    if args.pipeline_timeline:
        timeline = PipelineTimeline(state.pp_rank, state.pp, device, group=state.pp_group)
    run = Run(
        args=args,
        layout=layout,
        ctx=ctx,
        state=state,
        precision=precision,
        vocab_size=vocab,
        datasets=datasets,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        lr_schedule=lr_schedule(args),
        forward_backward=build_forward_backward(args, state, device, timeline, precision.residual_dtype),
        timeline=timeline,
        tlog=log.TrainingLog(
            log_config, flops=model_flops_per_iteration(flops), world_size=ctx.world_size, device=device
        ),
        tensorboard=log.TensorBoardLog(log_config, enabled=state.rank == ctx.world_size - 1),
        peak_meter=peak_meter,
        backend=LocalBackend(
            model,
            optimizer,
            state,
            clip_grad=optim.clip_grad,
            scaler=scaler,
            overlap_grad_reduce=ddp.overlap_grad_reduce,
            bucket_size=ddp.bucket_size,
            reduce_dtype=torch.bfloat16 if ddp.grad_reduce_in_bf16 else None,
        )
        if mesh is None
        else fsdp2.FSDP2Backend(model, optimizer, clip_grad=optim.clip_grad),
        checkpointer=checkpointer.Checkpointer(checkpoint_config(args), state, device),
        housekeeping=housekeeping_config(args),
        profiler=profiler_config(args),
    )
    if args.deepspeed:
        use_deepspeed(run)
    if args.load:
        load(run)
    if state.pp > 1:
        print_on(rank0, describe(args.pipeline_schedule, state.pp, layout.num_micro_batches, state.vp))
    return run


def ramp_line(layout: Layout) -> str:
    """The start-up line of a batch-size ramp: each step's first sample and global batch."""
    steps = ", ".join(f"{size} from sample {first}" for first, size in layout.batch_schedule)
    return f"> batch-size ramp: global batch {steps}"


def use_deepspeed(run: Run) -> None:
    """Hand the model and the run's optimizer to ``deepspeed.initialize``; step through the engine."""
    config = deepspeed_run_config(run.args, run.layout)
    print_on(run.rank0, deepspeed_config.describe(config))
    engine = deepspeed_engine.initialize(run.model, run.optimizer, config)
    run.deepspeed_config, run.backend = config, deepspeed_engine.DeepSpeedBackend(engine)


def parallelize_model(
    args: PretrainArgs, state: ParallelState, model: GPTModel, device: torch.device
) -> DeviceMesh | None:
    """PyTorch's parallel API on the run's one ``DeviceMesh`` (None without it): DTensor TP
    (``--tensor-parallel-impl dtensor``) over ``mesh["tp"]``, then ``--use-torch-fsdp2``'s
    ``fully_shard`` of every block and the root over ``mesh["dp"]``, in place. Between the two,
    every data-parallel rank 0 prints its parameter count: its tensor-parallel shard (DTensor
    local shards), per (tensor, pipeline) model-parallel rank as Megatron counts, before FSDP2;
    and ``--torch-compile`` compiles the blocks (with or without a mesh)."""
    layout = state.layout
    dtensor = args.tensor_parallel_impl == "dtensor" and layout.tp > 1
    mesh = None
    if dtensor or args.use_torch_fsdp2:
        # imported only by runs that use it: torch.distributed.tensor.parallel imports FSDP, whose
        # import before a DeepSpeed ZeRO-2 run leaves a gloo group's threads alive (main's c1bfd2c)
        from distlab.gpt.native import dtensor_parallel

        mesh = dtensor_parallel.device_mesh(layout, device)
        print_on(state.rank == 0, dtensor_parallel.describe_mesh(mesh))
    if dtensor:
        plan = dtensor_parallel.parallelize(model, mesh["tp"], sequence_parallel=args.sequence_parallel)
        print_on(state.rank == 0, dtensor_parallel.describe_plan(plan, mesh["tp"]))
    parameters = (
        dtensor_parallel.local_numel(model) if dtensor else sum(p.numel() for p in model.parameters())
    )
    print_on(
        state.dp_rank == 0 and state.cp_rank == 0,
        PARAMETERS.format(tp_rank=state.tp_rank, pp_rank=state.pp_rank, parameters=parameters),
    )
    if args.torch_compile:  # after TP's plan, before fully_shard (torchtitan's order)
        print_on(state.rank == 0, torch_compile.compile_blocks(model.layers))
    if args.use_torch_fsdp2:
        from distlab.gpt.native import fsdp2

        config = fsdp2.FSDP2Config.from_args(args)
        fsdp2.shard_model(model, mesh["dp"], config, device)
        print_on(state.rank == 0, config.describe(mesh["dp"], len(model.layers)))
    return mesh


def _warm_up_kernels(run_model: GPTConfig, optim: OptimizerConfig, precision: Precision) -> None:
    """One step of a one-layer GPT (the run's precision and residual dtype, recomputation and
    optimizer), thrown away, so that the code of the kernels and the thread pools are resident before the CPU meter's
    baseline: the first iteration's peak is then the run's tensors, not libtorch's pages (about 180 MiB)."""
    cfg = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=2, vocab_size=128,
                    max_position_embeddings=16,
                    recompute_granularity=run_model.recompute_granularity,
                    recompute_method=run_model.recompute_method,
                    recompute_num_layers=1 if run_model.recompute_num_layers else None,  # of its one layer
                    attention_backend=run_model.attention_backend,
                    fp32_residual_connection=run_model.fp32_residual_connection)  # fmt: skip
    single = ParallelState(Layout(1), rank=0)
    model = GPTModel(cfg, single)
    tokens = torch.randint(0, 128, (2, 17))  # (b, s + 1)
    batches = [(tokens[:, :-1], tokens[:, 1:])]  # tokens, labels: (b, s) each
    backend = LocalBackend(model, build_optimizer(model, optim), single, clip_grad=1.0)
    train_step(
        backend, batches, state=single, autocast=functools.partial(precision.autocast, torch.device("cpu"))
    )


def _build_datasets(args: PretrainArgs, tokenizer, rank0: bool) -> list[GPTDataset | None]:
    """Train, validation and test samples for every iteration and evaluation of the run, from
    --data-path (memory-mapped unless --no-mmap-bin-files) or Megatron's mock documents (--mock-data)."""
    B = args.global_batch_size
    n_evals = evaluations_during_training(args) + 1
    wanted = [args.train_iters * B, n_evals * args.eval_iters * B, args.eval_iters * B]
    if args.mock_data:
        source = MockIndexedDataset(tokenizer.vocab_size, tokenizer.eod)
    else:
        source = IndexedDataset(args.data_path, mmap=args.mmap_bin_files)
    datasets = build_datasets(
        source, parse_split(args.split), args.seq_length, wanted, args.seed, cache_dir=args.data_cache_path
    )
    sizes = ", ".join(f"{d.name} {len(d)} samples ({d.num_epochs} epoch(s))" for d in datasets if d)
    how = "Megatron's mock GPT documents" if args.mock_data else f"{args.data_path} ({_reader(args)})"
    print_on(rank0, f"> datasets from {how}: {sizes}")
    if args.data_cache_path is not None:
        hits = [d.name for d in datasets if d and d.cache_hit]
        print_on(rank0, f"> data cache {args.data_cache_path}: index arrays of "
                 f"{', '.join(hits) or 'no split'} read back, the others written")  # fmt: skip
    return datasets


def _reader(args: PretrainArgs) -> str:
    return ".bin memory-mapped" if args.mmap_bin_files else ".bin read per sample, --no-mmap-bin-files"


def build_model(args: PretrainArgs, state: ParallelState, vocab: int, device: torch.device) -> GPTModel:
    """This rank's stage and tensor-parallel shard of the GPT (whole with DTensor TP: split later)."""
    # dropout; the weights come from init_parameters. Megatron's two streams (tensor_parallel/rng_tracker.py):
    # the default one alike on the tp ranks, the model-parallel one (+ 2718 + tp_rank) for what
    # each tp rank holds alone (its heads; with SP its positions)
    model_parallel_manual_seed(args.seed + 100 * state.pp_rank, state.tp_rank)
    # SP by this engine's layers; with dtensor, DTensor's SequenceParallel plan does it instead
    cfg = model_config(
        args, vocab, state.layout.sequence_parallel and args.tensor_parallel_impl == "megatron"
    )
    dtensor = args.tensor_parallel_impl == "dtensor"  # unsharded here, split by parallelize_model
    return GPTModel(cfg, None if dtensor else state).to(device)


def build_forward_backward(
    args: PretrainArgs,
    state: ParallelState,
    device: torch.device,
    timeline: PipelineTimeline | None,
    dtype: torch.dtype = torch.float32,
) -> Callable[..., torch.Tensor]:
    """pp = 1: a loop over the micro-batches; pp > 1: GPipe, 1F1B or interleaved 1F1B (v > 1),
    sending ``dtype`` between stages: the residual stream's (``Precision.residual_dtype``, Megatron's
    ``pipeline_dtype``): the --bf16 / --fp16 dtype, fp32 with --fp32-residual-connection or in fp32."""
    if state.pp == 1:
        return forward_backward
    sp = state.tp if state.layout.sequence_parallel else 1  # SP: T / tp per rank
    shape = (
        args.micro_batch_size,
        args.seq_length // (state.cp * sp),
        args.hidden_size,
    )  # (b, T/cp/sp, H) between stages
    spec = P2PSpec(shape, dtype, device, timeout_s=60 * args.distributed_timeout_minutes)
    return PipelineForwardBackward(
        state, spec, schedule=args.pipeline_schedule, timeline=timeline, chunks=state.vp
    )


def load(run: Run) -> None:
    """Resume from ``--load`` (model, optimizer, scaler, RNG, iteration, consumed samples)."""
    loaded = run.checkpointer.load(run.model, run.optimizer)  # --ckpt-format's
    if loaded is None:
        print_on(run.rank0, checkpointing.resume_line(run.args.load, None, run.ctx))
        return
    run.iteration, run.consumed, scaler_state = loaded
    if run.scaler is not None and scaler_state is not None:
        run.scaler.load_state_dict(scaler_state)
    print_on(run.rank0, checkpointing.resume_line(run.args.load, run.iteration, run.ctx))
