"""Train a ResNet on CIFAR-10 with DistributedDataParallel, under any launcher.

Prepare the data once, before any job (never inside one):
    python code/prepare_cifar.py                       # generated stand-in, offline (local cluster)
    python code/prepare_cifar.py --source download     # the real CIFAR-10 (needs internet)

One process:
    python code/train_cifar.py --epochs 2
One node, 2 processes (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT):
    torchrun --standalone --nproc-per-node=2 code/train_cifar.py
Two nodes from an sbatch script (one torchrun per node, rendezvous on the first node):
    srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=$LAB_PROCS_PER_NODE \
         --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID code/train_cifar.py
Open MPI, one Python process per rank (ranks from OMPI_COMM_WORLD_*):
    mpirun -np 4 --map-by ppr:2:node -x MASTER_ADDR -x MASTER_PORT python code/train_cifar.py
srun alone, one task per rank (ranks from SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID):
    srun --ntasks-per-node=2 --kill-on-bad-exit=1 python code/train_cifar.py

Environment: LAB_BACKEND (nccl or gloo; default: nccl with CUDA), DISTLAB_PG_TIMEOUT (seconds a
collective waits for a missing rank, default 300). Each rank prints one line per epoch:
    rank 1/4 node2 | epoch 2/2 | time 4.10 s | loss 0.6123 | acc 81.20% | 312.5 img/s

The steps of ``main``, in order:
    parse_args     flags, and the checks that need nothing but the flags (argparse's errors)
    check_inputs   on every rank, before the process group starts: the data, the rank count,
                   the checkpoint to resume, --data-parallel's GPUs (exit with the fix)
    build_run      process group, seeded model, optimizer, schedule, resume, start-up lines, loaders
    train          train_epoch until --epochs or --stop-after (set_epoch, reseed, a new DDP, one
                   epoch, evaluate, checkpoint), then the summary line
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from distlab import REPO_ROOT
from distlab.cifar import data, engine
from distlab.cifar.model import LAYERS, STEMS, ModelSpec, build_model, param_checksum
from distlab.distributed import DEFAULT_TIMEOUT_S, DistContext, DistEnv, discover, init_distributed, shutdown
from distlab.rank_process import cap_cpu_threads, print_on


def build_parser() -> argparse.ArgumentParser:
    """The command line: data, model, recipe, checkpoint, demos of pitfalls, process group."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--data-dir",
        default=os.environ.get("LAB_DATA", str(REPO_ROOT / "data")),
        help="folder holding cifar-10-batches-py (prepare_cifar.py writes it)",
    )
    p.add_argument("--model", default="resnet18", choices=sorted(LAYERS), help="torchvision ResNet depth")
    p.add_argument(
        "--width",
        type=int,
        default=64,
        help="channels of layer1 (64 = torchvision's; 16 with --stem imagenet for CPU runs)",
    )
    p.add_argument(
        "--stem",
        default="cifar",
        choices=STEMS,
        help="cifar: 3x3 conv, stride 1, no pool; imagenet: torchvision's 7x7/2 conv + max-pool",
    )
    p.add_argument("--epochs", type=int, default=10, help="epochs in total (the schedule spans them)")
    p.add_argument("--batch-size", type=int, default=128, help="PER RANK; global batch = this x world size")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine decay per epoch)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay")
    p.add_argument("--seed", type=int, default=0, help="same on every rank: same init, same shuffles")
    p.add_argument("--train-samples", type=int, default=0, help="use the first N training images (0: all)")
    p.add_argument("--eval-batch-size", type=int, default=256, help="per rank, for evaluation")
    p.add_argument(
        "--workers", type=int, default=-1, help="DataLoader workers per rank (-1: 4 on GPU, 0 on CPU)"
    )
    p.add_argument(
        "--checkpoint",
        default=str(REPO_ROOT / "runs" / "cifar" / "checkpoint.pt"),
        help="written by rank 0 after every epoch ('' = never)",
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint where it stopped")
    p.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="stop after this many epochs of this run, as a time limit would (0: never)",
    )
    p.add_argument(
        "--data-parallel",
        action="store_true",
        help="one process driving every visible GPU with nn.DataParallel (for the comparison)",
    )
    p.add_argument("--skip-set-epoch", action="store_true", help="the pitfall: never call sampler.set_epoch")
    p.add_argument(
        "--fail-on-rank", type=int, default=-1, help="raise an error on this rank in epoch 1 (demo)"
    )
    p.add_argument("--backend", default=os.environ.get("LAB_BACKEND", "auto"), help="nccl, gloo or auto")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="process-group timeout, seconds")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; exit with argparse's usage error (status 2) on a value no run can use."""
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "eval_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} is {getattr(args, name)}: it must be at least 1")
    if args.train_samples < 0 or args.stop_after < 0:
        p.error(f"--train-samples {args.train_samples} and --stop-after {args.stop_after} must be >= 0")
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint (the file an earlier run wrote)")
    return args


class Inputs(NamedTuple):
    """What :func:`check_inputs` loaded: the two image sets and the checkpoint to resume from.

    (NamedTuples, not dataclasses: a dataclass needs its module in ``sys.modules``, and the tests
    load this script from its path.)
    """

    train_set: Dataset
    test_set: Dataset
    resume: dict | None  # engine.load_checkpoint's dict with --resume, else None


def check_inputs(args: argparse.Namespace, env: DistEnv, spec: ModelSpec) -> Inputs:
    """Load what the run needs, or exit naming the fix; runs on every rank before any rendezvous."""
    train_set, test_set = load_datasets(args, env)
    try:
        resume = engine.load_checkpoint(args.checkpoint, spec) if args.resume else None
    except (FileNotFoundError, engine.CheckpointMismatch) as e:
        sys.exit(f"rank {env.rank}: {e}")
    if args.data_parallel and (env.world_size > 1 or torch.cuda.device_count() < 2):
        sys.exit(
            f"--data-parallel drives the GPUs of ONE process: found {torch.cuda.device_count()} GPUs "
            f"and {env.world_size} processes. It needs >= 2 GPUs and one process (skip it on CPU)"
        )
    return Inputs(train_set, test_set, resume)


def load_datasets(args: argparse.Namespace, env: DistEnv) -> tuple[Dataset, Dataset]:
    """Train set (its first --train-samples) and test set; exit when missing or smaller than the world."""
    try:
        train_set = data.ManifestCIFAR10(args.data_dir, train=True, transform=engine.make_transform(True))
        test_set = data.ManifestCIFAR10(args.data_dir, train=False, transform=engine.make_transform(False))
    except data.DatasetMissing as e:
        sys.exit(f"rank {env.rank}: {e}")
    if args.train_samples:
        train_set = torch.utils.data.Subset(train_set, range(min(args.train_samples, len(train_set))))
    if env.world_size > len(train_set):
        sys.exit(
            f"rank {env.rank}: {env.world_size} ranks but only {len(train_set)} training images: "
            "every rank needs at least one. Use fewer ranks or more images (--train-samples)"
        )
    return train_set, test_set


class Run(NamedTuple):
    """Everything the epochs use, built once by :func:`build_run`."""

    args: argparse.Namespace
    ctx: DistContext
    spec: ModelSpec
    bare: nn.Module  # the model: wrapped anew every epoch (parallelize), evaluated and checkpointed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DataLoader  # this rank's shard (DistributedSampler)
    test_loader: DataLoader  # images rank, rank + W, ...
    start_epoch: int  # epochs done before this run (from the checkpoint)
    host: str

    @property
    def rank0(self) -> bool:
        return self.ctx.rank == 0


def build_run(args: argparse.Namespace, spec: ModelSpec, env: DistEnv, inputs: Inputs) -> Run:
    """Start the process group; build the model (same seed on every rank), optimizer and cosine
    schedule; resume; print the start-up lines; make loaders. Each epoch wraps the model for data
    parallelism (:func:`parallelize`)."""
    ctx = init_distributed(None if args.backend == "auto" else args.backend, timeout_s=args.timeout, env=env)
    device = ctx.device
    threads = cap_cpu_threads(env.local_world_size) if device.type == "cpu" else "cuda"
    workers = args.workers if args.workers >= 0 else (4 if device.type == "cuda" else 0)
    torch.manual_seed(args.seed)  # identical initialisation on every rank (DDP also broadcasts rank 0's)
    bare: nn.Module = build_model(spec).to(device)
    optimizer = torch.optim.SGD(
        bare.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    start_epoch = restore(inputs.resume, bare, optimizer, scheduler, ctx)
    host = socket.gethostname()
    print_start(args, ctx, spec, inputs, host, threads, param_checksum(bare))  # before DDP's broadcast
    loader = engine.train_loader(
        inputs.train_set, batch_size=args.batch_size, seed=args.seed, workers=workers
    )
    test_loader = engine.eval_loader(inputs.test_set, batch_size=args.eval_batch_size, workers=workers)
    return Run(args, ctx, spec, bare, optimizer, scheduler, loader, test_loader, start_epoch, host)


def restore(
    state: dict | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    ctx: DistContext,
) -> int:
    """Load a checkpoint's model, optimizer and schedule; the epoch to start from (0 without one)."""
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state.get("world_size") != ctx.world_size:
        print_on(
            ctx.rank == 0,
            f"note: checkpoint written by {state.get('world_size')} ranks, resuming on {ctx.world_size}: "
            "training goes on, but not bit-for-bit as an uninterrupted run",
        )
    return state["epoch"]


def print_start(
    args: argparse.Namespace,
    ctx: DistContext,
    spec: ModelSpec,
    inputs: Inputs,
    host: str,
    threads: str,
    checksum: float,
) -> None:
    """Every rank: who it is and its init checksum (equal on all ranks); rank 0: batch and data."""
    env, rank, size = ctx.env, ctx.rank, ctx.world_size
    print_on(
        True,
        f"rank {rank}/{size} {host} | launcher {env.launcher} | local rank {env.local_rank}/"
        f"{env.local_world_size} | {ctx.backend} on {ctx.device} | {threads} | "
        f"init checksum {checksum:.6f}",
    )
    print_on(
        rank == 0,
        f"config: {spec.describe()} | per-rank batch {args.batch_size} x {size} ranks = global batch "
        f"{args.batch_size * size} | {len(inputs.train_set)} train / {len(inputs.test_set)} test images | "
        f"{data.describe(args.data_dir)}",
    )


def parallelize(model: nn.Module, args: argparse.Namespace, ctx: DistContext) -> nn.Module:
    """DataParallel with --data-parallel, DDP on more than one rank, else the model itself.

    Called at the start of every epoch, so that a resumed run reduces its gradients exactly as
    the uninterrupted one. DDP's first step after its construction all-reduces every gradient in
    one bucket; from the second step on it uses buckets rebuilt in the order backward produced the
    gradients. The ring all-reduce adds the ranks' values in an order that depends on where an
    element sits in its bucket, so with three or more ranks the same gradients reduced in the two
    layouts differ in the last bit. A DDP kept for the whole run would give a resumed run's first
    step the one-bucket layout where the uninterrupted run used the rebuilt one, and the two runs
    would drift apart by rounding from the resumed run's second step on (measured: 5e-8 in an epoch's
    mean loss in notebook 03's local run, 2e-4 by the third epoch of the tests' tiny model: either
    can change a printed digit). A new DDP every epoch starts every epoch alike; it costs one
    broadcast of the weights, which every rank holds already.
    """
    if args.data_parallel:
        return nn.DataParallel(model)  # one process, scatters each batch over the GPUs
    if ctx.world_size > 1:
        return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    return model


def train(run: Run) -> list[dict]:
    """Epochs ``start_epoch + 1`` to --epochs (or --stop-after of them); the records of each."""
    args = run.args
    if run.start_epoch >= args.epochs:
        print_on(
            run.rank0, f"checkpoint is at epoch {run.start_epoch} of {args.epochs}: nothing left to train"
        )
    records, run_start = [], time.perf_counter()
    for epoch in range(run.start_epoch, args.epochs):
        records.append(train_epoch(run, epoch))
        if stop_now(run, epoch, len(records)):
            break
    if records:
        size = run.ctx.world_size
        print_on(
            run.rank0,
            f"done: {len(records)} epochs in {time.perf_counter() - run_start:.2f} s on {size} ranks "
            f"({max(size // max(run.ctx.env.local_world_size, 1), 1)} nodes) | final acc {100 * records[-1]['acc']:.2f}%",
        )
    return records


def train_epoch(run: Run, epoch: int) -> dict:
    """One epoch (0-based ``epoch``): shuffle, reseed, wrap, train, evaluate, print, checkpoint."""
    args, rank, size, device = run.args, run.ctx.rank, run.ctx.world_size, run.ctx.device
    if not args.skip_set_epoch:
        run.loader.sampler.set_epoch(epoch)  # new shuffle each epoch, the same on every rank
    torch.manual_seed(args.seed + 1_000_003 * (epoch + 1) + 7_919 * rank)  # augmentation: resumable
    model = parallelize(run.bare, args, run.ctx)  # a new DDP: every epoch buckets alike (see there)
    if epoch == 0 and rank == args.fail_on_rank:
        raise RuntimeError(f"rank {rank} fails on purpose (--fail-on-rank {args.fail_on_rank})")
    stats = engine.train_one_epoch(model, run.loader, run.optimizer, device)
    run.scheduler.step()
    acc, test_loss = engine.evaluate(run.bare, run.test_loader, device)
    print_on(
        True,
        f"rank {rank}/{size} {run.host} | epoch {epoch + 1}/{args.epochs} | time {stats.seconds:.2f} s | "
        f"loss {stats.loss:.4f} | acc {100 * acc:.2f}% | {stats.images / stats.seconds:.1f} img/s",
    )
    if args.checkpoint:
        engine.save_checkpoint(
            args.checkpoint, spec=run.spec, model=run.bare, optimizer=run.optimizer,
            scheduler=run.scheduler, epoch=epoch + 1, extra={"world_size": size},
        )  # fmt: skip
    return {"epoch": epoch + 1, "losses": stats.losses, "loss": stats.loss, "acc": acc,
            "test_loss": test_loss, "seconds": stats.seconds}  # fmt: skip


def stop_now(run: Run, epoch: int, epochs_run: int) -> bool:
    """--stop-after: true (and say how to go on) after that many epochs of this run, unless the last."""
    args = run.args
    if not (args.stop_after and epochs_run >= args.stop_after and epoch + 1 < args.epochs):
        return False
    print_on(
        run.rank0,
        f"stopping after epoch {epoch + 1} (--stop-after {args.stop_after}); "
        f"continue with --resume --checkpoint {args.checkpoint}",
    )
    return True


@record  # under torchrun, a failing rank's traceback is reported in the job's log
def main(argv: list[str] | None = None) -> list[dict]:
    """Train from a command line; every epoch's record on this rank (epoch, losses, acc, ...)."""
    args = parse_args(argv)
    env = discover()
    spec = ModelSpec(args.model, args.width, args.stem)
    inputs = check_inputs(args, env, spec)  # every check that can fail, before the process group
    records = train(build_run(args, spec, env, inputs))
    shutdown()
    return records


if __name__ == "__main__":
    main()
