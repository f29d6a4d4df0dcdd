"""Notebook 07's exercise: one ZeRO-1 AdamW step by hand, judged against torch's AdamW on 2 gloo ranks.

ZeRO stage 1 (Rajbhandari et al. 2020) shards the optimizer state over the N data-parallel ranks
(notebook 07's notation: N ranks, P parameters). The parameters, flattened and padded to N x S
elements (S = ceil(P / N)), are cut into N shards; rank r owns elements [r S, (r + 1) S) and keeps
AdamW's two moments for those only::

    grads (N S,) on every rank --reduce-scatter, / N--> g_r (S,)       the ranks' average, own shard
    AdamW(w_r, g_r; m_r, v_r)                          --> w_r (S,)     8 S bytes of state per rank
    [w_0 | w_1 | ... | w_(N-1)]  <--all-gather--            w_r         every rank: the whole model

The learner's file (``jobs/zero1_adamw.py``) defines ``ZeRO1AdamW(params, lr, betas, eps,
weight_decay)`` with ``step()``; its own shard of the weights is ``self.main`` and, after
``step()``, ``self.main.grad`` holds the gradient its update used. :func:`check_zero1` trains
:data:`STEPS` steps of a small MLP on :data:`WORLD` spawned ranks, each on its half of the batch,
against one process running ``torch.optim.AdamW`` on the whole batch. Judged, in this order: the
learner's code runs; the parameters after every step equal the reference's within :data:`RTOL` of
its change (a right answer differs by ~4e-6: the same sums in another order); the bytes of tensors
the optimizer keeps between steps, besides the weights it updates and their gradients
(:func:`kept_bytes`), are at most 1/N of torch's AdamW state on the whole model (plus the padding);
the gradient shard equals the ranks' average on the own elements (AdamW alone hardly tells: it
divides by the gradient's own size, so a sum instead of an average moves the weights by ~1e-7).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

from distlab.exercises.ranks import file_untouched, learner_error, not_yet, run_on_ranks, share, verdict

NAME = "one ZeRO-1 AdamW step"
WORLD = 2
STEPS = 3
PER_RANK = 8  # samples per rank and step
SIZES = (32, 64, 64, 9)  # the MLP's widths: P = 6,857 parameters (odd: the last shard is padded)
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
RTOL = 1e-4  # the largest parameter difference, relative to the reference's change of the parameters
COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather",
               "all_gather_single", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "gather", "scatter", "send", "recv", "isend", "irecv")  # fmt: skip


def fresh_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(SIZES[:-1], SIZES[1:], strict=False):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def batch(step: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s inputs ``(b, SIZES[0])`` and classes: rank ``rank``'s half, or all of it."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(WORLD * PER_RANK, SIZES[0], generator=gen)
    y = torch.randint(0, SIZES[-1], (WORLD * PER_RANK,), generator=gen)
    if rank is None:
        return x, y
    return x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def num_parameters() -> int:
    return sum(p.numel() for p in fresh_model().parameters())


def describe() -> str:
    """What the learner needs for a prediction: the model, its N, the ranks, AdamW's settings."""
    model = fresh_model()
    shapes = ", ".join(str(tuple(p.shape)) for p in model.parameters())
    return (
        f"MLP {' -> '.join(map(str, SIZES))}: P = {num_parameters():,} fp32 parameters in "
        f"{len(list(model.parameters()))} tensors ({shapes}); N = {WORLD} ranks, {PER_RANK} samples "
        f"each per step; AdamW {HYPER}"
    )


def kept_bytes(optimizer, model: nn.Module) -> int:
    """Bytes of the tensors ``optimizer`` keeps (its attributes, through lists, dicts and torch
    optimizers' state), each storage once, except the weights it updates (the model's parameters,
    its torch optimizers' parameters, a ``main`` attribute) and their gradients."""
    weights = [*model.parameters(), getattr(optimizer, "main", None)]
    inner = []
    todo, seen, found = [optimizer], set(), {}
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, nn.Module | ModuleType | type):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, torch.optim.Optimizer):
            inner += [p for group in obj.param_groups for p in group["params"]]
            todo += list(obj.state.values())
        elif isinstance(obj, dict):
            todo += list(obj.values())
        elif isinstance(obj, list | tuple | set):
            todo += list(obj)
        else:  # an object of the learner's: its attributes (one without a __dict__ holds none)
            with contextlib.suppress(TypeError):
                todo += list(vars(obj).values())
    for w in [*weights, *inner]:
        if isinstance(w, torch.Tensor):
            for t in (w, w.grad):
                if t is not None:
                    found.pop(t.untyped_storage().data_ptr(), None)
    return sum(found.values())


def adamw_state_bytes() -> int:
    """Bytes of torch's AdamW state on the whole model (two moments and a step per tensor)."""
    model = fresh_model()
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    x, y = batch(0)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    return kept_bytes(optimizer, model)


class _Recorder:
    """Wraps torch.distributed's collectives while the learner's ``step()`` runs: their names."""

    def __init__(self) -> None:
        self.called: list[str] = []
        self.originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def __enter__(self) -> _Recorder:
        for name, fn in self.originals.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    def _wrap(self, name: str, fn):
        def recorded(*args, **kwargs):
            self.called.append(name)
            return fn(*args, **kwargs)

        return recorded


def _reference() -> tuple[list[torch.Tensor], torch.Tensor]:
    """torch's AdamW on one process and the whole batch: parameters after each step, and before."""
    model = fresh_model()
    start = flat(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), **HYPER)
    params = []
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        params.append(flat(model.parameters()))
    return params, start


def _body(rank: int, module: ModuleType, path: str) -> dict:
    """One rank: the learner's optimizer for STEPS steps; what the verdicts need."""
    model = fresh_model()
    shard = -(-num_parameters() // WORLD)
    params, grad_errors, called = [], [], []
    try:
        with _Recorder() as rec:
            optimizer = module.ZeRO1AdamW(model.parameters(), **HYPER)
            for step in range(STEPS):
                x, y = batch(step, rank)
                model.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                local = flat(p.grad for p in model.parameters())  # (N,) before step() may touch it
                rec.called.clear()
                optimizer.step()
                called = sorted(set(rec.called))
                params.append(flat(model.parameters()))
                main = getattr(optimizer, "main", None)
                mine = None if main is None or main.grad is None else main.grad.detach().reshape(-1).clone()
                dist.all_reduce(local)  # the ranks' average, the checker's own (outside the recording)
                want = (local / WORLD)[rank * shard : (rank + 1) * shard]
                if mine is None or mine.numel() != shard:
                    grad_errors.append(None if mine is None else f"{mine.numel()} elements")
                else:
                    scale = float(mine[: want.numel()] @ want / (want @ want))
                    err = float((mine[: want.numel()] - want).abs().max() / want.abs().max())
                    grad_errors.append([err, scale])
    except Exception as exc:  # noqa: BLE001 - the learner's code may fail anywhere; report it
        return {"error": learner_error(exc, path)}
    kept = kept_bytes(optimizer, model)
    reference, start = _reference()
    errors = [
        float((p - r).abs().max() / (r - start).abs().max()) for p, r in zip(params, reference, strict=True)
    ]
    return {
        "error": None,
        "rel_errors": errors,
        "params": params[0].tolist(),  # after step 1, to compare the ranks
        "called": called,
        "kept": kept,
        "grad_errors": grad_errors,
    }


def _grad_problem(ranks: list[dict]) -> tuple[str | None, bool]:
    """What is wrong with the gradient shards the learner's update used, and whether it is only
    that ``self.main.grad`` is missing (None: nothing)."""
    shard = -(-num_parameters() // WORLD)
    for r, res in enumerate(ranks):
        for step, g in enumerate(res["grad_errors"], start=1):
            if g is None:
                return (
                    f"self.main.grad is empty after step() on rank {r}: put the gradient your update uses there",
                    True,
                )
            if isinstance(g, str):
                return (
                    f"self.main.grad has {g} on rank {r}, but a rank owns {shard}: the ceiling of P / N",
                    False,
                )
            err, scale = g
            if not err <= 1e-5:
                return (
                    f"in step {step}, rank {r}'s gradient shard is {scale:.2f} times the ranks' average on its "
                    f"elements (off by {share(err)} of its largest value). AdamW divides by the gradient's own size, "
                    "so the weights move almost as they should (only eps and the weight decay tell). What does "
                    "the reduce-scatter compute?"
                ), False
    return None, False


def _problem(ranks: list[dict], full: int) -> str | None:
    """What is wrong with the ranks' reports, in words (None: nothing); ``full``: torch's AdamW state."""
    failed = [(r, res["error"]) for r, res in enumerate(ranks) if res["error"]]
    if failed:
        r, error = failed[0]
        return f"your code raised on rank {r}: {error}"
    grads, missing = _grad_problem(ranks)
    worst = max(e for res in ranks for e in res["rel_errors"])
    if not worst <= RTOL:
        if grads and not missing:
            return grads  # the more precise diagnosis
        apart = sum(a != b for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True))
        ranks_say = (
            f"your {WORLD} ranks hold different parameters after step 1 ({apart} of {num_parameters()} elements "
            "differ): every rank must end a step with the whole updated model"
            if apart
            else "your ranks agree with each other"
        )
        called = ", ".join(ranks[0]["called"]) or "none"
        return (
            f"after {STEPS} steps your parameters differ from torch's AdamW on the whole batch by {share(worst)} of "
            f"its change (at most {share(RTOL)} is right); {ranks_say}. Collectives your step() called: {called}. "
            "Which gradient does one process use, and which elements does each rank update?"
        )
    kept = max(res["kept"] for res in ranks)
    if kept > full / WORLD * 1.02 + 64:
        return (
            f"each rank keeps {kept:,} bytes of optimizer state (tensors held between steps, besides the weights "
            f"it updates and their gradients) where torch's AdamW on the whole model keeps {full:,}: ZeRO-1 keeps "
            f"1/N = 1/{WORLD} of that. Which elements does a rank's optimizer need state for?"
        )
    return grads


def run(path: str | Path) -> list[dict]:
    """The learner's optimizer on :data:`WORLD` spawned ranks, beside the reference: each rank's report."""
    return run_on_ranks(_body, path, WORLD, str(Path(path).resolve()))


def judge(ranks: list[dict]) -> bool:
    """The verdict on the ranks' reports: ``[ok]`` with the state measured, or ExerciseError."""
    full = adamw_state_bytes()
    problem = _problem(ranks, full)
    if problem:
        return verdict(NAME, problem, "")
    worst = max(e for res in ranks for e in res["rel_errors"])
    kept = max(res["kept"] for res in ranks)
    return verdict(
        NAME,
        None,
        f"{STEPS} steps on {WORLD} ranks equal torch's AdamW on the whole batch (largest difference {share(worst)} "
        f"of its change, tolerance {share(RTOL)}); each rank keeps {kept:,} bytes of optimizer state, torch's AdamW "
        f"on the whole model {full:,}: {kept / full:.3f} of it (1/N = {1 / WORLD:.3f})",
    )


def check_zero1(path: str | Path = "jobs/zero1_adamw.py") -> bool:
    """Notebook 07's check: ``[not yet]`` while ``path`` holds FIXME, else :func:`judge` of :func:`run`."""
    if file_untouched(path):
        what = f"write ZeRO1AdamW in {path} (replace every FIXME), run its cell, then this one"
        return not_yet(NAME, what)
    return judge(run(path))


def is_state_bytes_right(predicted) -> bool:
    """``predicted`` is within 2% of 1/N of torch's AdamW state on the whole model (measured here)."""
    if not isinstance(predicted, int | float) or isinstance(predicted, bool):
        return False
    return abs(predicted / (adamw_state_bytes() / WORLD) - 1) <= 0.02
