"""Notebook 03's exercise: data parallelism by hand, judged against torch's DDP on 2 gloo ranks.

The learner's file (``jobs/ddp_by_hand.py``) defines ``BucketedAllReduce(model, bucket_size)``.
After ``loss.backward()`` and its ``finish()``, every ``.grad`` must be the average of the ranks'
gradients, g = (1/W) sum_r g_r, computed as DDP computes it::

    backward   fc, layer4 ... layer1, conv1      gradients ready, last layer first
    buckets    [ 0 ][ 1 ] ... [ B-1 ]            the parameters reversed, >= bucket_size elements each
    hooks      bucket i complete -> all_reduce(flat_i, async_op=True)     while backward goes on
    finish()   wait for every handle; grad = sum / W                       then optimizer.step()

:func:`check_ddp_by_hand` runs it on :data:`WORLD` spawned gloo ranks for :data:`STEPS` SGD steps of
the notebook's model (ResNet-18, width 16, torchvision's stem) on :data:`PER_RANK` images per rank
drawn as the notebook's generated set draws them, and then torch's ``DistributedDataParallel`` from
the same weights on the same images. Judged, in this order: the learner's code runs; every step
all-reduces once per bucket, each with ``async_op=True``, all started before backward returned
(from the hooks), none waited for inside backward, all waited for before the optimizer step; the
parameters after every step equal DDP's within :data:`RTOL` of DDP's own change (the solution's are
DDP's to the last bit, a sum instead of an average is 100% off). Measured and printed: the share of the
all-reduces' time that passed while backward was still running (each all-reduce from its start to
its completion, seen by a callback on its future), and the time ``finish()`` waited.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.cifar.data import synthesize
from distlab.cifar.engine import MEAN, STD
from distlab.cifar.model import ModelSpec, build_model
from distlab.exercises.ranks import file_untouched, learner_error, not_yet, run_on_ranks, share, verdict

NAME = "data parallelism by hand"
WORLD = 2
STEPS = 3
PER_RANK = 8  # images per rank and step: the global batch is WORLD x PER_RANK
SPEC = ModelSpec(width=16, stem="imagenet")  # the notebook's model on the local cluster (703,386 parameters)
BUCKET_SIZE = 100_000  # elements: 6 buckets of this model
LR = 0.1
RTOL = 1e-3  # the largest parameter difference from DDP, relative to DDP's change of the parameters


def images(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(PER_RANK, 3, 32, 32)`` normalised images and labels of step ``step``."""
    pixels, labels = synthesize(WORLD * PER_RANK, np.random.default_rng(1000 + step))
    x = torch.tensor(pixels).permute(0, 3, 1, 2).float() / 255
    x = (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return x[mine], torch.tensor(labels)[mine]


def fresh_model() -> nn.Module:
    torch.manual_seed(0)
    return build_model(SPEC)


class _Recorder:
    """Wraps ``dist.all_reduce`` while the learner's class trains: when each call starts, whether it
    is asynchronous, when its handle is waited for (``wait`` or ``get_future``) and when it completes."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.step, self.in_backward = 0, False
        self.original = dist.all_reduce

    def __enter__(self) -> _Recorder:
        dist.all_reduce = self._all_reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self.original

    def _all_reduce(self, tensor, *args, **kwargs):
        call = {"step": self.step, "start": time.perf_counter(), "in_backward": self.in_backward}
        call["async"] = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
        self.calls.append(call)
        work = self.original(tensor, *args, **kwargs)
        if work is None:
            call["done"] = time.perf_counter()
            return None
        work.get_future().then(lambda _f: call.setdefault("done", time.perf_counter()))
        return _Watched(work, call, self)


class _Watched:
    """A handle that records when it is waited for (and whether backward was still running)."""

    def __init__(self, work, call: dict, recorder: _Recorder) -> None:
        self._work, self._call, self._recorder = work, call, recorder

    def _waited(self) -> None:
        self._call.setdefault("waited", time.perf_counter())
        self._call["waited_in_backward"] = self._call.get("waited_in_backward") or self._recorder.in_backward

    def wait(self, *args, **kwargs):
        self._waited()
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self._waited()
        return self._work.get_future()

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _train_learner(rank: int, module: ModuleType) -> dict:
    model = fresh_model()
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    params, losses, steps = [], [], []
    with _Recorder() as rec:
        averager = module.BucketedAllReduce(model, BUCKET_SIZE)
        for step in range(STEPS):
            x, y = images(step, rank)
            rec.step = step
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            t0 = time.perf_counter()
            rec.in_backward = True
            loss.backward()
            rec.in_backward = False
            t1 = time.perf_counter()
            averager.finish()
            t2 = time.perf_counter()
            calls = [c for c in rec.calls if c["step"] == step]
            steps.append(
                {
                    "backward_ms": 1e3 * (t1 - t0),
                    "finish_ms": 1e3 * (t2 - t1),
                    "calls": len(calls),
                    "sync": sum(not c["async"] for c in calls),
                    "after_backward": sum(not c["in_backward"] for c in calls),
                    "waited_in_backward": sum(bool(c.get("waited_in_backward")) for c in calls),
                    "not_waited": sum(c["async"] and "waited" not in c for c in calls),
                    "comm_ms": 1e3 * sum(c.get("done", t2) - c["start"] for c in calls),
                    "hidden_ms": 1e3 * sum(max(0.0, min(c.get("done", t2), t1) - c["start"]) for c in calls),
                }
            )
            optimizer.step()
            losses.append(loss.item())
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    buckets = len(getattr(averager, "buckets", [])) or None
    return {"model": (start, params), "losses": losses, "steps": steps, "buckets": buckets}


def _train_ddp(rank: int) -> tuple[list, list[float]]:
    # DDP warns that the downsampling 1x1 convolutions' gradients have other strides than its buckets
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    model = fresh_model()
    ddp = DDP(model, bucket_cap_mb=BUCKET_SIZE * 4 / 2**20)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    params, losses = [], []
    for step in range(STEPS):
        x, y = images(step, rank)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return params, losses


def _body(rank: int, module: ModuleType, path: str) -> dict:
    """One rank: the learner's class for STEPS steps, then DDP's; what the verdicts need."""
    try:
        mine = _train_learner(rank, module)
    except Exception as exc:  # noqa: BLE001 - the learner's code may fail anywhere; report it
        return {"error": learner_error(exc, path)}
    start, params = mine.pop("model")
    ddp_params, ddp_losses = _train_ddp(rank)
    start = torch.cat([p.reshape(-1) for p in start])
    errors = []
    for got, want in zip(params, ddp_params, strict=True):  # per step: |mine - DDP| / |DDP - start|
        errors.append(float((got - want).abs().max() / (want - start).abs().max()))
    first = ddp_params[0] - start  # DDP's first update; how much of it the learner's first update is
    scale = float((params[0] - start) @ first / (first @ first))
    return {**mine, "error": None, "rel_errors": errors, "ddp_losses": ddp_losses, "update_ratio": scale}


def _problem(ranks: list[dict], buckets: int) -> str | None:
    """What is wrong with the ranks' reports, in words (None: nothing)."""
    failed = [(r, res["error"]) for r, res in enumerate(ranks) if res["error"]]
    if failed:
        r, error = failed[0]
        return f"your code raised on rank {r}: {error}"
    steps = [s for res in ranks for s in res["steps"]]
    if any(s["calls"] == 0 for s in steps):
        return "a step started no all-reduce (dist.all_reduce): nothing was averaged over the ranks"
    if any(s["sync"] for s in steps):
        return (
            "an all-reduce ran synchronously: it returns only when the sum has arrived, and backward "
            "waits for it; start it so that backward can go on while it travels, and keep what it returns"
        )
    counts = sorted({s["calls"] for s in steps})
    if counts != [buckets]:
        return (
            f"a step started {' or '.join(map(str, counts))} all-reduces for {buckets} buckets: why does "
            "DDP group the gradients into buckets, and when is a bucket ready?"
        )
    late = max(s["after_backward"] for s in steps)
    if late:
        return (
            f"{late} of {buckets} all-reduces started after loss.backward() had returned, so nothing "
            "overlapped with backward: a bucket can leave as soon as backward produced its last gradient"
        )
    if any(s["waited_in_backward"] for s in steps):
        return (
            "backward stopped to wait for an all-reduce (a handle waited for while backward ran): "
            "the later buckets could not start meanwhile. Where is the first moment that needs the sums?"
        )
    if any(s["not_waited"] for s in steps):
        return (
            "an all-reduce's handle was never waited for before the optimizer step: the step may read "
            "a gradient before its sum has arrived"
        )
    worst = max(e for res in ranks for e in res["rel_errors"])
    if not worst <= RTOL:
        ratio = ranks[0]["update_ratio"]
        return (
            f"your parameters differ from DDP's by {share(worst)} of DDP's change (at most {share(RTOL)} is "
            f"right), and your ranks' first update is {ratio:.2f} times DDP's: which gradient does DDP give "
            "every rank, and what does all_reduce compute?"
        )
    return None


def _summary(ranks: list[dict], buckets: int) -> str:
    steps = [s for res in ranks for s in res["steps"][1:]]  # the first step warms up
    comm, hidden = sum(s["comm_ms"] for s in steps), sum(s["hidden_ms"] for s in steps)
    backward = np.mean([s["backward_ms"] for s in steps])
    waited = np.mean([s["finish_ms"] for s in steps])
    worst = max(e for res in ranks for e in res["rel_errors"])
    return (
        f"{STEPS} steps on {WORLD} ranks equal DDP's (largest difference {share(worst)} of DDP's change, "
        f"tolerance {share(RTOL)}); {buckets} all-reduces per step, all started during backward. Of their "
        f"time, {hidden / comm:.0%} passed while backward ran ({comm / len(steps):.1f} ms per step "
        f"and rank); finish() then waited {waited:.1f} ms after a {backward:.1f} ms backward"
    )


def run(path: str | Path) -> list[dict]:
    """The learner's class, then DDP, on :data:`WORLD` spawned ranks: each rank's report."""
    return run_on_ranks(_body, path, WORLD, str(Path(path).resolve()))


def judge(ranks: list[dict]) -> bool:
    """The verdict on the ranks' reports: ``[ok]`` with the overlap measured, or ExerciseError."""
    buckets = ranks[0].get("buckets") or len(bucket_sizes())
    problem = _problem(ranks, buckets)
    return verdict(NAME, problem, "" if problem else _summary(ranks, buckets))


def check_ddp_by_hand(path: str | Path = "jobs/ddp_by_hand.py") -> bool:
    """Notebook 03's check: ``[not yet]`` while ``path`` holds FIXME, else :func:`judge` of :func:`run`."""
    if file_untouched(path):
        what = f"write BucketedAllReduce in {path} (replace every FIXME), run its cell, then this one"
        return not_yet(NAME, what)
    return judge(run(path))


def bucket_sizes(bucket_size: int = BUCKET_SIZE) -> list[int]:
    """Elements per bucket of the exercise's model: the parameters reversed, closed at >= ``bucket_size``."""
    sizes, numel = [], 0
    for p in reversed(list(fresh_model().parameters())):
        numel += p.numel()
        if numel >= bucket_size:
            sizes.append(numel)
            numel = 0
    return sizes + [numel] * (numel > 0)


def first_ready() -> str:
    """The module whose parameter's gradient backward accumulates first, measured with hooks."""
    model = fresh_model()
    names = {p: name for name, p in model.named_parameters()}
    order: list[str] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: order.append(names[q]))
    x, y = images(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    return order[0].rpartition(".")[0]


def is_first_ready(answer) -> bool:
    """``answer`` names the module of :func:`first_ready` (or one of its parameters)."""
    name = str(answer).strip().removeprefix("model.").removeprefix("module.")
    layer = first_ready()
    return name == layer or name.rpartition(".")[0] == layer
