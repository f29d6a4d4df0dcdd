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
         --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT code/train_cifar.py
Open MPI, one Python process per rank (ranks from OMPI_COMM_WORLD_*):
    mpirun -np 4 --map-by ppr:2:node -x MASTER_ADDR -x MASTER_PORT python code/train_cifar.py
srun alone, one task per rank (ranks from SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID):
    srun --ntasks-per-node=2 --kill-on-bad-exit=1 python code/train_cifar.py

Environment: LAB_BACKEND (nccl or gloo; default: nccl with CUDA), DISTLAB_PG_TIMEOUT (seconds a
collective waits for a missing rank, default 300). Each rank prints one line per epoch:
    rank 1/4 node2 | epoch 2/2 | time 4.10 s | loss 0.6123 | acc 81.20% | 312.5 img/s
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab import REPO_ROOT
from distlab.cifar import data, engine
from distlab.cifar.model import LAYERS, STEMS, ModelSpec, build_model, param_checksum
from distlab.distributed import (
    DEFAULT_TIMEOUT_S,
    cap_cpu_threads,
    discover,
    init_distributed,
    print_on,
    shutdown,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "eval_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} is {getattr(args, name)}: it must be at least 1")
    if args.train_samples < 0 or args.stop_after < 0:
        p.error(f"--train-samples {args.train_samples} and --stop-after {args.stop_after} must be >= 0")
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint (the file an earlier run wrote)")
    return args


@record  # under torchrun, a failing rank's traceback is reported in the job's log
def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    env = discover()
    spec = ModelSpec(args.model, args.width, args.stem)
    # ---- every check that can fail runs here, on every rank, before the process group starts ----
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
    try:
        state = engine.load_checkpoint(args.checkpoint, spec) if args.resume else None
    except (FileNotFoundError, engine.CheckpointMismatch) as e:
        sys.exit(f"rank {env.rank}: {e}")
    if args.data_parallel and (env.world_size > 1 or torch.cuda.device_count() < 2):
        sys.exit(
            f"--data-parallel drives the GPUs of ONE process: found {torch.cuda.device_count()} GPUs "
            f"and {env.world_size} processes. It needs >= 2 GPUs and one process (skip it on CPU)"
        )

    ctx = init_distributed(None if args.backend == "auto" else args.backend, timeout_s=args.timeout, env=env)
    device, rank, size = ctx.device, ctx.rank, ctx.world_size
    threads = cap_cpu_threads(env.local_world_size) if device.type == "cpu" else "cuda"
    workers = args.workers if args.workers >= 0 else (4 if device.type == "cuda" else 0)

    torch.manual_seed(args.seed)  # identical initialisation on every rank (DDP also broadcasts rank 0's)
    model: nn.Module = build_model(spec).to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    start_epoch = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch = state["epoch"]
        if state.get("world_size") != size:
            print_on(
                rank == 0,
                f"note: checkpoint written by {state.get('world_size')} ranks, resuming on {size}: "
                "training goes on, but not bit-for-bit as an uninterrupted run",
            )
    host = socket.gethostname()
    print_on(
        True,
        f"rank {rank}/{size} {host} | launcher {env.launcher} | local rank {env.local_rank}/"
        f"{env.local_world_size} | {ctx.backend} on {device} | {threads} | "
        f"init checksum {param_checksum(model):.6f}",
    )
    print_on(
        rank == 0,
        f"config: {spec.describe()} | per-rank batch {args.batch_size} x {size} ranks = global batch "
        f"{args.batch_size * size} | {len(train_set)} train / {len(test_set)} test images | "
        f"{data.describe(args.data_dir)}",
    )
    if args.data_parallel:
        model = nn.DataParallel(model)  # one process, scatters each batch over the GPUs
    elif size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    bare = model.module if isinstance(model, (DDP, nn.DataParallel)) else model

    loader = engine.train_loader(train_set, batch_size=args.batch_size, seed=args.seed, workers=workers)
    test_loader = engine.eval_loader(test_set, batch_size=args.eval_batch_size, workers=workers)
    if start_epoch >= args.epochs:
        print_on(rank == 0, f"checkpoint is at epoch {start_epoch} of {args.epochs}: nothing left to train")
    records, run_start = [], time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        if not args.skip_set_epoch:
            loader.sampler.set_epoch(epoch)  # new shuffle each epoch, the same on every rank
        torch.manual_seed(args.seed + 1_000_003 * (epoch + 1) + 7_919 * rank)  # augmentation: resumable
        if epoch == 0 and rank == args.fail_on_rank:
            raise RuntimeError(f"rank {rank} fails on purpose (--fail-on-rank {args.fail_on_rank})")
        stats = engine.train_one_epoch(model, loader, optimizer, device)
        scheduler.step()
        acc, test_loss = engine.evaluate(bare, test_loader, device)
        print_on(
            True,
            f"rank {rank}/{size} {host} | epoch {epoch + 1}/{args.epochs} | time {stats.seconds:.2f} s | "
            f"loss {stats.loss:.4f} | acc {100 * acc:.2f}% | {stats.images / stats.seconds:.1f} img/s",
        )
        records.append(
            {
                "epoch": epoch + 1,
                "losses": stats.losses,
                "loss": stats.loss,
                "acc": acc,
                "test_loss": test_loss,
                "seconds": stats.seconds,
            }
        )
        if args.checkpoint:
            engine.save_checkpoint(
                args.checkpoint,
                spec=spec,
                model=bare,
                optimizer=optimizer,
                scheduler=scheduler,
                epoch=epoch + 1,
                extra={"world_size": size},
            )
        if args.stop_after and len(records) >= args.stop_after and epoch + 1 < args.epochs:
            print_on(
                rank == 0,
                f"stopping after epoch {epoch + 1} (--stop-after {args.stop_after}); "
                f"continue with --resume --checkpoint {args.checkpoint}",
            )
            break
    if records:
        print_on(
            rank == 0,
            f"done: {len(records)} epochs in {time.perf_counter() - run_start:.2f} s on {size} ranks "
            f"({max(size // max(env.local_world_size, 1), 1)} nodes) | final acc {100 * records[-1]['acc']:.2f}%",
        )
    shutdown()
    return records


if __name__ == "__main__":
    main()
