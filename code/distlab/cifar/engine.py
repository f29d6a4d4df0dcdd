"""Data loaders, one training epoch, rank-count-independent evaluation, one-writer checkpoints.

Data-parallel contract (world size W, per-rank batch b, global batch B = W * b):

    training   DistributedSampler: each epoch a permutation seeded by (seed, epoch) is cut into W
               interleaved shards of ceil(N / W) indices (padded by repeating a few); rank r takes
               shard r. ``set_epoch(e)`` before each epoch, or every epoch repeats epoch 0's order.
    evaluation rank r scores images r, r + W, r + 2W, ... (no padding, no repeats); the sums
               (correct, count, loss) are all-reduced, so accuracy = correct / N for any W.
    checkpoint rank 0 writes (to a temporary file, then renames), between two barriers: nobody
               races ahead or reads a half-written file; the other ranks never touch the disk.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms

from distlab.cifar.model import ModelSpec

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10 per-channel statistics


def make_transform(train: bool) -> transforms.Compose:
    """The usual CIFAR augmentation (random 4-pixel shift, horizontal flip) and normalisation."""
    steps = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if train else []
    return transforms.Compose([*steps, transforms.ToTensor(), transforms.Normalize(MEAN, STD)])


def world() -> tuple[int, int]:
    """(rank, world size), (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def train_loader(dataset, *, batch_size: int, seed: int, workers: int = 0) -> DataLoader:
    """This rank's shard of ``dataset``, reshuffled every epoch once ``sampler.set_epoch`` is called."""
    rank, size = world()
    sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers)


def eval_loader(dataset, *, batch_size: int, workers: int = 0) -> DataLoader:
    """Images ``rank, rank + W, ...`` of ``dataset``: every image scored exactly once over all ranks."""
    rank, size = world()
    shard = Subset(dataset, range(rank, len(dataset), size))
    return DataLoader(shard, batch_size=batch_size, shuffle=False, num_workers=workers)


@dataclass
class EpochStats:
    """What one rank saw in one epoch."""

    losses: list[float]  # loss of every step on this rank, in order
    images: int  # images this rank trained on
    seconds: float

    @property
    def loss(self) -> float:
        return sum(self.losses) / max(len(self.losses), 1)


def train_one_epoch(
    model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, device: torch.device
) -> EpochStats:
    """One pass over this rank's shard. Under DDP, ``backward`` averages gradients over ranks."""
    model.train()
    losses: list[float] = []
    images, start = 0, time.perf_counter()
    for x, y in loader:  # x: (b, 3, 32, 32), y: (b,)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)  # this rank's mean over its b images
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP: all-reduce (mean) of gradients, overlapped with backward
        optimizer.step()
        losses.append(loss.item())
        images += len(y)
    return EpochStats(losses, images, time.perf_counter() - start)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """(accuracy, mean loss) over the whole evaluation set, the same on every rank for any W.

    Pass the bare model (``ddp.module``): ranks score different numbers of batches, and DDP's
    forward would wait for matching calls on every rank.
    """
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # (correct, count, loss sum)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)  # (b, classes)
        sums[0] += (logits.argmax(dim=1) == y).sum()
        sums[1] += len(y)
        sums[2] += F.cross_entropy(logits, y, reduction="sum").double()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)  # sum over ranks: every image counted exactly once
    return float(sums[0] / sums[1]), float(sums[2] / sums[1])


class CheckpointMismatch(ValueError):
    """The checkpoint belongs to another model or run."""


def save_checkpoint(
    path: str | os.PathLike,
    *,
    spec: ModelSpec,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    epoch: int,
    extra: dict,
) -> None:
    """Rank 0 writes ``path`` atomically after epoch ``epoch`` (1-based); all ranks must call this."""
    path = Path(path)
    barrier()  # every rank finished the epoch: nobody still reads or steps
    if world()[0] == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "spec": spec.as_dict(),
            "epoch": epoch,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            **extra,
        }
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact
    barrier()  # the file is complete before anyone goes on (e.g. to a job that resumes from it)


def load_checkpoint(path: str | os.PathLike, spec: ModelSpec) -> dict:
    """Read a checkpoint on every rank and check it was written for ``spec``; raise a clear error if not."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume: no checkpoint at {path}. Run without --resume first, "
            "or point --checkpoint at the file the earlier run wrote"
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("spec") != spec.as_dict():
        theirs = ModelSpec(**state["spec"]).describe() if "spec" in state else "an unknown model"
        raise CheckpointMismatch(
            f"checkpoint {path} holds {theirs}, but this run builds {spec.describe()}: pass the "
            "same --model/--width/--stem as the run that wrote it, or use another --checkpoint"
        )
    return state
