"""Notebook 05's exercise: tensor parallelism by hand, f and g and an MLP split over 2 gloo ranks.

Megatron's MLP (Shoeybi et al. 2019, section 3), ``Y = GeLU(X A + a) C + c`` over the t ranks of a
tensor-parallel group: A split by columns (rank r computes its F/t hidden units), C by rows (rank r
multiplies its hidden units by its rows of C, a partial sum of Y). Two conjugate operators glue it::

    rank r:  X --f--> X A_r + a_r --GeLU--> H_r --> H_r C_r --g--> sum_r H_r C_r + c = Y
    f: identity forward, all-reduce backward          g: all-reduce forward, identity backward

The learner's file (``jobs/tp_mlp.py``) defines ``f`` and ``g`` (``torch.autograd.Function``),
``ColumnParallelLinear`` and ``RowParallelLinear``, each built from a full ``nn.Linear`` (its
``weight`` stores A^T, shape (out, in)) and the group, and uses them in ``ParallelMLP(fc1, fc2,
group)``. :func:`check_tp_mlp` runs it on :data:`WORLD` gloo ranks spawned on this machine (the
CPU, on any site; :func:`distlab.exercises.ranks.run_on_ranks`),
in float64, against the full MLP in one process with the same weights. Judged in this order: the
file imports and runs; each rank holds the engine's shards (``layers.shard``: fc1's rows, fc2's
columns, fc2's bias whole); the output, X's gradient and the weights' gradients equal one
process's within :data:`TOLERANCE`; one forward and one backward call one all-reduce each and no
other collective. A wrong answer is told which part is off and, for the usual mistakes (no sum in
f's backward, a sum in both directions in g, fc2 split along the wrong dimension, its bias on
every rank's partial sum), why, without the code. The engine's own version
(``distlab.gpt.tensor_parallel``) is shown after the exercise.

The notebook's predictions of the all-reduces are judged here too: :func:`check_layer_prediction`
(per transformer layer and micro-batch, before the exercise) and :func:`check_step_prediction`
(per step of the TP = 2 job, before it runs); the expected values are computed here, not shown.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab.checks import check
from distlab.exercises.ranks import file_untouched, learner_error, not_yet, run_on_ranks
from distlab.gpt.tensor_parallel.layers import shard

NAME = "f, g and the tensor-parallel MLP"
WORLD = 2  # t, the tensor-parallel ranks
SIZES = dict(b=2, s=3, h=8, ffn=32)  # micro batch, sequence, hidden, MLP width F = 4h
TOLERANCE = 1e-9
"""Largest error accepted, relative to the largest value of each tensor compared (float64: a right
answer differs by ~1e-16, the order of two sums; every usual mistake by 0.1 or more)."""
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "send",
               "recv", "isend", "irecv", "barrier")  # fmt: skip

ERROR_HINT = "Read the error: it names your file's line."
MISMATCH_HINT = (
    "A rank waited in a collective that the other rank left (or never called): every rank of the group "
    "must call the same collectives, in the same order, on tensors of the same shape."
)
PARAMETER_HINT = (
    "Give ColumnParallelLinear and RowParallelLinear their weight and bias as nn.Parameter "
    "(self.weight, self.bias): the check reads their gradients there."
)
ROW_DIM_HINT = (
    "RowParallelLinear holds fc2's weight split along the wrong dimension. Rank r's input is its own "
    "slice of the hidden units (b, s, F/t), the GeLU of its ColumnParallelLinear: which part of fc2's "
    "weight (stored as (out, in) = (h, F)) multiplies exactly those units?"
)
ROW_SLICE_HINT = (
    "RowParallelLinear's weight has the right shape but not the right part of fc2's weight: rank r's "
    "hidden units are the r-th contiguous block of F/t (fc1 gives it those rows); its part of fc2 must "
    "be the one that multiplies them."
)
SHAPE_HINT = (
    "Each rank holds fc1's weight as (F/t, h) with its bias (F/t,), and fc2's weight as (h, F/t) with "
    "the whole bias (h,), as the comments of the file say."
)
PARTIAL_HINT = (
    "Each rank's output is only its own partial product H_r C_r (+ c): Y is the sum of every rank's "
    "part, and the ranks have not combined theirs. Where in the MLP do the partial sums leave the "
    "tensor-parallel region, and what must happen there in forward?"
)
BIAS_HINT = (
    "The output is off by (t - 1) c: fc2's bias c is counted once per rank. Add it once, where the "
    "output is the same on every rank."
)
INPUT_SUM_HINT = (
    "The column-parallel layers see t times X. X is already the same on every rank when it enters the "
    "tensor-parallel region: what is there to combine in f's forward?"
)
FORWARD_HINT = (
    "The output differs from one process's. Y = GeLU(X A + a) C + c: rank r computes its columns of "
    "A, its rows of C, and the ranks' partial products are added once."
)
INPUT_GRAD_HINT = (
    "The output and the weights' gradients are right, but X's gradient is not: on rank r it holds only "
    "what flows back through rank r's columns of A. X fed every rank's columns, so its gradient needs "
    "every rank's part. Which operator stands where X enters, and what does it do in backward?"
)
DOUBLE_GRAD_HINT = (
    "Everything before g gets t times its gradient. Y = Z_0 + Z_1 + c (Z_r: rank r's partial product), "
    "so dL/dZ_r = dL/dY, which every rank already holds: does g's backward need the other ranks' dY?"
)
BACKWARD_HINT = (
    "The output is right but these gradients are not. Backward runs the operators in reverse, and f "
    "and g are conjugate: each one's backward does what the other does in forward."
)
COUNT_HINT = (
    "Your numbers are right, but not your collectives. Each direction needs one sum over the ranks, of "
    "the one tensor that differs between them: X, and Y's gradient, are already the same on every rank."
)


# ----------------------------------------------------------------------------------------------
# The reference: the full MLP in one process, and the parts the diagnosis compares with
# ----------------------------------------------------------------------------------------------


def inputs() -> tuple[nn.Linear, nn.Linear, torch.Tensor, torch.Tensor]:
    """fc1 (h -> F), fc2 (F -> h), X (b, s, h) and the probe P (b, s, h) of the loss sum(Y * P),
    float64, the same in every process (seeded)."""
    b, s, h, ffn = SIZES.values()
    gen = torch.Generator().manual_seed(5)
    fc1, fc2 = nn.Linear(h, ffn, dtype=torch.float64), nn.Linear(ffn, h, dtype=torch.float64)
    with torch.no_grad():
        for layer in (fc1, fc2):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen, dtype=torch.float64) * 0.5)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(b, s, h, generator=gen, dtype=torch.float64)
    probe = torch.randn(b, s, h, generator=gen, dtype=torch.float64)
    return fc1, fc2, x, probe


def reference(scale_x: float = 1.0) -> dict[str, torch.Tensor]:
    """One process: Y, dX and every weight's gradient of loss = sum(Y * P), for X x ``scale_x``;
    and, per rank, the partial output H_r C_r^T + c and the part of dX through rank r's columns."""
    fc1, fc2, x, probe = inputs()
    x = (x * scale_x).requires_grad_()
    y = fc2(F.gelu(fc1(x)))  # (b, s, h)
    (y * probe).sum().backward()
    out = {"y": y.detach(), "dx": x.grad, "w1": fc1.weight.grad, "b1": fc1.bias.grad,
           "w2": fc2.weight.grad, "b2": fc2.bias.grad, "c": fc2.bias.detach()}  # fmt: skip
    for r in range(WORLD):
        w1, b1 = (shard(t.detach(), 0, WORLD, r) for t in (fc1.weight, fc1.bias))
        w2 = shard(fc2.weight.detach(), 1, WORLD, r)
        xr = x.detach().clone().requires_grad_()
        hidden = F.gelu(F.linear(xr, w1, b1))  # (b, s, F/t)
        partial = F.linear(hidden, w2)  # (b, s, h), rank r's share of Y - c
        (partial * probe).sum().backward()
        out[f"partial{r}"], out[f"dx{r}"] = partial.detach() + fc2.bias.detach(), xr.grad
    return out


def expected_shards(r: int) -> dict[str, torch.Tensor]:
    """Rank r's parameters as the engine splits them: fc1 by rows of its weight (A's columns) with
    its bias, fc2 by columns of its weight (C's rows), fc2's bias whole."""
    fc1, fc2, _, _ = inputs()
    return {
        "w1": shard(fc1.weight.detach(), 0, WORLD, r),
        "b1": shard(fc1.bias.detach(), 0, WORLD, r),
        "w2": shard(fc2.weight.detach(), 1, WORLD, r),
        "b2": fc2.bias.detach(),
    }


# ----------------------------------------------------------------------------------------------
# One rank: the learner's file, run and measured
# ----------------------------------------------------------------------------------------------


class _Recorder:
    """Wraps torch.distributed's collectives, and the learner module's own names for them (``from
    torch.distributed import all_reduce``), recording their names while ``on``."""

    def __init__(self, module: ModuleType) -> None:
        self.on, self.called = False, []
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original)
            setattr(dist, name, wrapped)
            for key, value in list(vars(module).items()):
                if value is original:
                    setattr(module, key, wrapped)

    def _wrap(self, name: str, fn):
        def recorded(*args, **kwargs):
            if self.on:
                self.called.append(name)
            return fn(*args, **kwargs)

        return recorded

    def take(self) -> list[str]:
        called, self.called = self.called, []
        return called


def _as_list(t) -> list | None:
    return t.detach().tolist() if isinstance(t, torch.Tensor) else None


def _body(rank: int, module: ModuleType, path: str) -> dict:
    """The learner's ParallelMLP on this rank (``ranks.run_on_ranks`` imported the file): its shards,
    Y, the gradients, the collectives of one forward and one backward."""
    recorder = _Recorder(module)
    group = dist.new_group(list(range(WORLD)))
    report: dict = {"error": None, "shapes": {}}
    try:
        fc1, fc2, x, probe = inputs()
        mlp = module.ParallelMLP(fc1, fc2, group)
        params = {"w1": mlp.fc1.weight, "b1": mlp.fc1.bias, "w2": mlp.fc2.weight, "b2": mlp.fc2.bias}
        report["shapes"] = {
            k: list(p.shape) if isinstance(p, torch.Tensor) else None for k, p in params.items()
        }
        report["params"] = {k: _as_list(p) for k, p in params.items()}
        report["leaf"] = all(isinstance(p, nn.Parameter) for p in params.values())
        x.requires_grad_()
        recorder.on = True
        y = mlp(x)
        report["forward_calls"] = recorder.take()
        (y * probe).sum().backward()
        report["backward_calls"] = recorder.take()
        recorder.on = False
        report["y"], report["dx"] = _as_list(y), _as_list(x.grad)
        report["grads"] = {k: _as_list(getattr(p, "grad", None)) for k, p in params.items()}
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the learner's code may fail anywhere; report it
        report["error"] = learner_error(exc, path)
    return report


def run(path: str | Path) -> list[dict]:
    """The learner's file on :data:`WORLD` spawned gloo ranks (``ranks.run_on_ranks``): each rank's
    report, by rank."""
    return run_on_ranks(_body, path, WORLD, str(Path(path).resolve()))


# ----------------------------------------------------------------------------------------------
# The verdict
# ----------------------------------------------------------------------------------------------


def _error(got, want: torch.Tensor) -> float:
    """Largest difference relative to ``want``'s largest value (inf when shapes differ)."""
    if got is None:
        return float("inf")
    got = torch.tensor(got, dtype=torch.float64)
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / want.abs().max())


def _scale(got, want: torch.Tensor) -> float:
    got = torch.tensor(got, dtype=torch.float64).reshape(-1)
    want = want.reshape(-1)
    return float(got @ want / (want @ want)) if got.numel() == want.numel() else float("nan")


def _shard_problem(ranks: list[dict]) -> tuple[str, str] | None:
    """(what is off, hint) for shards that are not the engine's; None when they are (or unknown)."""
    h, ffn, t = SIZES["h"], SIZES["ffn"], WORLD
    want = {"w1": [ffn // t, h], "b1": [ffn // t], "w2": [h, ffn // t], "b2": [h]}
    names = {"w1": "fc1's weight", "b1": "fc1's bias", "w2": "fc2's weight", "b2": "fc2's bias"}
    for r, rep in enumerate(ranks):
        shapes = rep.get("shapes") or {}
        if not shapes:
            return None  # failed before the shards: the error says why
        if shapes.get("w2") == [h // t, ffn]:
            return f"rank {r} holds fc2's weight as {tuple(shapes['w2'])}", ROW_DIM_HINT
        for k, shape in want.items():
            if shapes.get(k) != shape:
                got = "no tensor" if shapes.get(k) is None else f"shape {tuple(shapes[k])}"
                return f"rank {r} holds {names[k]} as {got}, not {tuple(shape)}", SHAPE_HINT
        expected = expected_shards(r)
        for k in ("w1", "b1", "b2"):
            if _error(rep["params"][k], expected[k]) > TOLERANCE:
                return f"rank {r}'s {names[k]} is not the engine's part of the full layer", SHAPE_HINT
        if _error(rep["params"]["w2"], expected["w2"]) > TOLERANCE:
            return f"rank {r}'s part of fc2's weight", ROW_SLICE_HINT
    return None


def _forward_problem(ranks: list[dict], ref: dict, doubled: dict) -> tuple[str, str] | None:
    for r, rep in enumerate(ranks):
        err = _error(rep["y"], ref["y"])
        if err <= TOLERANCE:
            continue
        said = f"rank {r}'s Y, off by {err:.2g} of its largest value"
        if _error(rep["y"], ref[f"partial{r}"]) <= TOLERANCE:
            return said, PARTIAL_HINT
        if _error(rep["y"], ref["y"] + (WORLD - 1) * ref["c"]) <= TOLERANCE:
            return said, BIAS_HINT
        if _error(rep["y"], doubled["y"]) <= TOLERANCE:
            return said, INPUT_SUM_HINT
        return said, FORWARD_HINT
    return None


def _backward_problem(ranks: list[dict], ref: dict) -> tuple[str, str] | None:
    names = {"dx": "X's", "w1": "fc1's weight", "b1": "fc1's bias", "w2": "fc2's weight", "b2": "fc2's bias"}
    for r, rep in enumerate(ranks):
        if not rep.get("leaf") or any(g is None for g in rep["grads"].values()):
            return f"rank {r}'s parameters: no gradient", PARAMETER_HINT
        want = {"dx": ref["dx"], **expected_grads(ref, r)}
        got = {"dx": rep["dx"], **rep["grads"]}
        wrong = [k for k in want if _error(got[k], want[k]) > TOLERANCE]
        if not wrong:
            continue
        said = f"on rank {r} " + ", ".join(
            f"{names[k]} gradient ({_scale(got[k], want[k]):.2f} times one process's, off by "
            f"{_error(got[k], want[k]):.2g})"
            for k in wrong
        )
        if wrong == ["dx"] and _error(got["dx"], ref[f"dx{r}"]) <= TOLERANCE:
            return said, INPUT_GRAD_HINT
        if "w2" in wrong and "b2" not in wrong and abs(_scale(got["w2"], want["w2"]) - WORLD) < 1e-6:
            return said, DOUBLE_GRAD_HINT
        return said, BACKWARD_HINT
    return None


def expected_grads(ref: dict, r: int) -> dict[str, torch.Tensor]:
    """Rank r's parameters' gradients: its shards of one process's."""
    return {
        "w1": shard(ref["w1"], 0, WORLD, r),
        "b1": shard(ref["b1"], 0, WORLD, r),
        "w2": shard(ref["w2"], 1, WORLD, r),
        "b2": ref["b2"],
    }


def _calls(names: list[str]) -> str:
    if not names:
        return "no collective"
    counted = {n: names.count(n) for n in dict.fromkeys(names)}
    return ", ".join(f"{n} x {k}" for n, k in counted.items())


def judge(ranks: list[dict]) -> tuple[str, bool, str]:
    """(what to show of the answer, right?, hint) from the ranks' reports (:func:`run`)."""
    shards = _shard_problem(ranks)
    if shards:
        return shards[0], False, shards[1]
    failed = [(r, rep["error"]) for r, rep in enumerate(ranks) if rep["error"]]
    if failed:
        r, error = failed[0]
        stranded = any(word in error for word in ("Connection closed by peer", "timed out", "Timed out"))
        return f"your code raised on rank {r}: {error}", False, MISMATCH_HINT if stranded else ERROR_HINT
    ref = reference()
    problem = _forward_problem(ranks, ref, reference(scale_x=WORLD)) or _backward_problem(ranks, ref)
    if problem:
        return problem[0], False, problem[1]
    fwd, bwd = ranks[0]["forward_calls"], ranks[0]["backward_calls"]
    called = f"one forward called {_calls(fwd)}, one backward {_calls(bwd)}"
    if any(
        rep["forward_calls"] != ["all_reduce"] or rep["backward_calls"] != ["all_reduce"] for rep in ranks
    ):
        return called, False, COUNT_HINT
    worst = max(_error(rep[k], ref[k]) for rep in ranks for k in ("y", "dx"))
    worst = max([worst] + [_error(rep["grads"][k], v) for r, rep in enumerate(ranks)
                           for k, v in expected_grads(ref, r).items()])  # fmt: skip
    said = (
        f"on {WORLD} ranks Y and the gradients of X and every weight equal one process's (largest difference "
        f"{worst:.1e} of the largest value, tolerance {TOLERANCE:.0e}); {called}"
    )
    return said, True, ""


def check_tp_mlp(path: str | Path = "jobs/tp_mlp.py", *, name: str = NAME) -> bool:
    """Notebook 05's check: ``[not yet]`` while ``path`` is missing or holds FIXME; otherwise the
    file on :data:`WORLD` gloo ranks against one process (:func:`judge`): ``[ok]`` or ExerciseError."""
    if file_untouched(path):
        return not_yet(
            name,
            f"write f, g and the two layers in {path} (replace every FIXME), run its cell, then this one",
        )
    try:
        ranks = run(path)
    except Exception as exc:  # noqa: BLE001 - a rank's process died (the learner's code exited or crashed)
        return check(name, f"a rank's process ended early: {exc}", ok=lambda _: False, hint=ERROR_HINT)
    said, right, hint = judge(ranks)
    return check(name, said, ok=lambda _: right, hint=hint)


# ----------------------------------------------------------------------------------------------
# The predictions
# ----------------------------------------------------------------------------------------------

LAYER_PREDICTION = "all-reduces per transformer layer and micro-batch at t = 2"
STEP_PREDICTION = "all-reduces of a (b, s, h) activation per step, TP = 2 job"


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_layer_prediction(predicted) -> bool:
    """The learner's ``{"forward": n, "backward": n}``, all-reduces per transformer layer and
    micro-batch: attention and MLP, each a column-parallel then a row-parallel layer (exact)."""
    expected = {"forward": 2, "backward": 2}  # per pair: g forward, f backward; two pairs per layer
    return check(
        LAYER_PREDICTION,
        predicted,
        ok=lambda p: (
            isinstance(p, dict) and set(p) == set(expected) and all(p[k] == v for k, v in expected.items())
        ),
        hint="Count the f and g of one column-parallel -> row-parallel pair in each direction (your MLP's "
        "check printed it); a layer has two such pairs, attention's and the MLP's.",
    )


def check_step_prediction(
    predicted, *, num_layers: int, micro_batches: int, measured: float | None = None
) -> bool:
    """The learner's count of (b, s, h) all-reduces per step on rank 0 of a TP run of ``num_layers``
    layers and ``micro_batches`` micro-batches per step (exact): each layer's, plus the vocabulary-
    parallel embedding's g forward and the output layer's f backward, per micro-batch. ``measured``
    (the trace's count) is printed beside it."""
    expected = (4 * num_layers + 2) * micro_batches
    ok = check(
        STEP_PREDICTION,
        predicted,
        ok=lambda p: _count(p) and p == expected,
        hint=f"per micro-batch: each layer's all-reduces (both directions) times l = {num_layers} layers, plus the "
        f"embedding's g and the output layer's f; per step, times m = {micro_batches} micro-batches",
    )
    if measured is not None:
        print(f"measured in the trace: {measured:.0f} per step")
    return ok


__all__ = [
    "check_layer_prediction",
    "check_step_prediction",
    "check_tp_mlp",
    "expected_shards",
    "inputs",
    "judge",
    "reference",
    "run",
]
