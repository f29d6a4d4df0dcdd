"""Notebook 05's write-it-yourself exercise (``distlab.exercises.tp_by_hand``): f, g and a column-
then row-parallel MLP, judged on 2 spawned gloo ranks against one process; and the notebook's two
predictions of all-reduces.

The notebook's own cells run here: its stub file says "not yet" (returns False, raises nothing, spawns
nothing); typical wrong files, made from the solution's by one change each (no sum in f's backward, a
sum in both directions in g, fc2 split along the wrong dimension or strided, its bias on every
partial sum, no g, a sum in f's forward, a needless all-reduce, a collective on one rank only, a
typo, an exit) are told wrong with a hint that gives neither the code nor the dimension; the
solution notebook's file passes, its error many orders of magnitude under the tolerance, in a few
seconds. The predictions' cells wait, pass and fail the same way.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from types import SimpleNamespace

import pytest

from distlab import REPO_ROOT
from distlab.checks import FIXME, ExerciseError
from distlab.exercises import tp_by_hand
from distlab.gpt.build import BATCH

NOTEBOOK = REPO_ROOT / "notebooks" / "05_tensor_pipeline_parallel.ipynb"
SOLUTION = REPO_ROOT / "solutions" / "05_tensor_pipeline_parallel_solution.ipynb"
#: What a hint must not say: the code of f, g or the split.
ANSWER_WORDS = ("all_reduce", "all-reduce", "dim=", "dim 1", "chunk", "identity", "clone", ".t()", "[:, ")


def cells(path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]


def learner_file(path) -> str:
    """The text the ``%%writefile jobs/tp_mlp.py`` cell writes."""
    cell = next(c for c in cells(path) if c.startswith("%%writefile jobs/tp_mlp.py\n"))
    return cell.split("\n", 1)[1]


def run_check_cell(tmp_path, monkeypatch, text: str | None) -> bool:
    """The notebook's check cell, in a folder whose jobs/tp_mlp.py holds ``text`` (None: no file)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobs").mkdir(exist_ok=True)
    if text is not None:
        (tmp_path / "jobs" / "tp_mlp.py").write_text(text)
    source = next(c for c in cells(NOTEBOOK) if c.startswith("tp_by_hand.check_tp_mlp("))
    namespace = {"tp_by_hand": tp_by_hand}
    exec(f"result = {source}", namespace)
    return namespace["result"]


def hint_of(error: ExerciseError) -> str:
    return str(error).split(" is not right. ", 1)[1]


SOLVED = learner_file(SOLUTION)


def changed(old: str, new: str) -> str:
    assert SOLVED.count(old) == 1, old
    return SOLVED.replace(old, new)


ROW_FORWARD = "return g.apply(F.linear(x, self.weight), self.group) + self.bias"
F_BACKWARD = """        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None"""
F_FORWARD = """        ctx.group = group
        return x
"""
WRONG = {
    "no sum in f's backward": (changed(F_BACKWARD, "        return grad, None"), tp_by_hand.INPUT_GRAD_HINT),
    "a sum in both directions in g": (
        changed(
            "    def backward(ctx, grad):\n        return grad, None",
            "    def backward(ctx, grad):\n        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n"
            "        return grad, None",
        ),
        tp_by_hand.DOUBLE_GRAD_HINT,
    ),
    "torch's autograd all-reduce as g": (
        changed(
            ROW_FORWARD,
            "return torch.distributed.nn.functional.all_reduce(F.linear(x, self.weight), group=self.group) + self.bias",
        ),
        tp_by_hand.DOUBLE_GRAD_HINT,
    ),
    "fc2 split along the wrong dimension": (
        changed("chunk(t, dim=1)[r]", "chunk(t, dim=0)[r]"),
        tp_by_hand.ROW_DIM_HINT,
    ),
    "fc2 split in strides": (
        changed("full.weight.detach().chunk(t, dim=1)[r].clone()", "full.weight.detach()[:, r::t].clone()"),
        tp_by_hand.ROW_SLICE_HINT,
    ),
    "fc2's bias on every partial sum": (
        changed(ROW_FORWARD, "return g.apply(F.linear(x, self.weight, self.bias), self.group)"),
        tp_by_hand.BIAS_HINT,
    ),
    "no g": (changed(ROW_FORWARD, "return F.linear(x, self.weight) + self.bias"), tp_by_hand.PARTIAL_HINT),
    "a sum in f's forward": (
        changed(
            F_FORWARD,
            "        ctx.group = group\n        x = x.clone()\n        dist.all_reduce(x, group=group)\n"
            "        return x\n",
        ),  # fmt: skip
        tp_by_hand.INPUT_SUM_HINT,
    ),
    "a needless all-reduce, divided again": (
        changed(
            F_FORWARD,
            "        ctx.group = group\n        x = x.clone()\n        dist.all_reduce(x, group=group)\n"
            "        return x / dist.get_world_size(group)\n",
        ),  # fmt: skip
        tp_by_hand.COUNT_HINT,
    ),
    "a typo": (changed("self.weight, self.bias)", "self.weights, self.bias)"), tp_by_hand.ERROR_HINT),
    "a collective on one rank only": (
        changed(
            F_BACKWARD,
            F_BACKWARD.replace(
                "        dist.all_reduce", "        if dist.get_rank() == 0:\n            dist.all_reduce"
            ),
        ),
        tp_by_hand.MISMATCH_HINT,
    ),
    "an exit": (
        changed(
            "        return F.linear(f.apply(",
            "        raise SystemExit(3)\n        return F.linear(f.apply(",
        ),
        tp_by_hand.ERROR_HINT,
    ),
}


def test_the_untouched_stub_is_not_yet(tmp_path, monkeypatch, capsys):
    start = time.perf_counter()
    assert run_check_cell(tmp_path, monkeypatch, learner_file(NOTEBOOK)) is False
    assert "[not yet]" in capsys.readouterr().out
    assert run_check_cell(tmp_path / "jobs", monkeypatch, None) is False  # the cell not run yet: no file
    assert "[not yet]" in capsys.readouterr().out
    assert time.perf_counter() - start < 0.5  # spawns nothing


def test_the_stub_is_the_solution_with_its_blanks():
    """Every line of the stub but its FIXME lines is in the solution's file, in the same order; the
    stub's prose never says FIXME (a file whose docstring did would stay "not yet" for ever)."""
    stub = learner_file(NOTEBOOK)
    kept = [line for line in stub.splitlines() if FIXME not in line]
    solution = iter(SOLVED.splitlines())
    assert all(any(line == s for s in solution) for line in kept)
    assert stub.count(FIXME) == 7 and FIXME not in stub.split('"""')[1]
    assert FIXME not in SOLVED


@pytest.mark.parametrize("why", list(WRONG))
def test_a_wrong_file_gets_its_hint_and_not_the_answer(why, tmp_path, monkeypatch):
    text, hint = WRONG[why]
    with pytest.raises(ExerciseError) as told:
        run_check_cell(tmp_path, monkeypatch, text)
    message = str(told.value)
    assert message.endswith(hint), message
    assert not any(word in hint_of(told.value) for word in ANSWER_WORDS), message


def test_the_solution_passes_with_margin(tmp_path, monkeypatch, capsys):
    tp_by_hand.run(tmp_path / "missing.py")  # the fork server started (its cost is the first check's)
    start = time.perf_counter()
    assert run_check_cell(tmp_path, monkeypatch, SOLVED) is True
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert out.startswith(f"[ok] {tp_by_hand.NAME}: "), out
    worst = float(re.search(r"largest difference ([0-9.e+-]+) ", out).group(1))
    assert worst < tp_by_hand.TOLERANCE / 1e4, out
    assert "one forward called all_reduce x 1, one backward all_reduce x 1" in out
    assert elapsed < 10.0  # a second or two on 2 idle cores


def test_a_right_file_in_other_words_passes(tmp_path, monkeypatch, capsys):
    """f and g written with ``from torch.distributed import all_reduce`` (its calls still counted),
    in place on autograd's own tensors, and fc2's part taken by slicing: right, and passes."""
    text = SOLVED.replace(
        "import torch.distributed as dist\n",
        "import torch.distributed as dist\nfrom torch.distributed import all_reduce\n",
    )
    text = text.replace(F_BACKWARD, "        all_reduce(grad, group=ctx.group)\n        return grad, None")
    text = text.replace(
        "        x = x.clone()\n        dist.all_reduce(x, group=group)\n",
        "        all_reduce(x, group=group)\n",
    )
    text = text.replace(
        "full.weight.detach().chunk(t, dim=1)[r].clone()",
        "full.weight.detach()[:, r * full.in_features // t : (r + 1) * full.in_features // t].clone()",
    )
    assert text.count("all_reduce(") == 2 and "dist.all_reduce" not in text and "dim=1" not in text
    assert run_check_cell(tmp_path, monkeypatch, text) is True
    assert "one forward called all_reduce x 1, one backward all_reduce x 1" in capsys.readouterr().out


def test_the_reference_is_the_engines_split():
    """The shards the check expects are the engine's (``layers.shard``: fc1's rows and fc2's columns in
    contiguous blocks, as ``ColumnParallelLinear.load_full_`` and ``RowParallelLinear.load_full_``
    keep them), and the reference's per-rank parts add up: the partial products to Y - c, the input
    gradients through each rank's columns to X's gradient."""
    import torch

    ref = tp_by_hand.reference()
    fc1, fc2, _, _ = tp_by_hand.inputs()
    for r in range(tp_by_hand.WORLD):
        shards = tp_by_hand.expected_shards(r)
        torch.testing.assert_close(shards["w1"], fc1.weight.detach().chunk(2, dim=0)[r])
        torch.testing.assert_close(shards["b1"], fc1.bias.detach().chunk(2, dim=0)[r])
        torch.testing.assert_close(shards["w2"], fc2.weight.detach().chunk(2, dim=1)[r])
    total = sum(ref[f"partial{r}"] - ref["c"] for r in range(tp_by_hand.WORLD)) + ref["c"]
    torch.testing.assert_close(total, ref["y"])
    torch.testing.assert_close(sum(ref[f"dx{r}"] for r in range(tp_by_hand.WORLD)), ref["dx"])


# ----------------------------------------------------------------------------------------------
# The predictions
# ----------------------------------------------------------------------------------------------


def test_the_layer_prediction_waits_passes_and_fails():
    cell = next(c for c in cells(NOTEBOOK) if c.startswith("predicted_allreduces_per_layer = "))
    namespace = {"FIXME": FIXME, "tp_by_hand": tp_by_hand}
    exec(cell, namespace)
    check_cell = next(c for c in cells(NOTEBOOK) if c.startswith("tp_by_hand.check_layer_prediction("))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert eval(check_cell, namespace) is False
    assert "[not yet]" in out.getvalue()
    for wrong in (
        {"forward": 1, "backward": 1},
        {"forward": 2, "backward": 0},
        {"forward": 4, "backward": 4},
        4,
    ):
        namespace["predicted_allreduces_per_layer"] = wrong
        with pytest.raises(ExerciseError) as told:
            eval(check_cell, namespace)
        assert "2" not in hint_of(told.value)
    solution = next(c for c in cells(SOLUTION) if c.startswith("predicted_allreduces_per_layer = "))
    exec(solution, namespace)
    with contextlib.redirect_stdout(io.StringIO()):
        assert eval(check_cell, namespace) is True


def test_the_step_prediction_waits_passes_and_fails():
    """The notebook's cell after the TP = 2 job's trace: m from the log, the (b, s, h) row of the
    trace, the prediction against (4 l + 2) m, the measured count printed beside."""
    cell = next(
        c for c in cells(NOTEBOOK) if c.startswith('m = megatron.batch_arithmetic(tp2.log())["accumulation"]')
    )
    from distlab.logs import megatron

    log = BATCH.format(global_batch=4, micro_batch=2, dp=1, accumulation=2)
    namespace = {
        "megatron": megatron,
        "tp_by_hand": tp_by_hand,
        "tp2": SimpleNamespace(log=lambda: log),
        "rows": [
            {"shape": (2, 64, 64), "per_step": 36.0, "numel": 8192},
            {"shape": (2, 64), "per_step": 6.0},
        ],
        "MICRO": 2,
        "SEQ": 64,
        "h": 64,
        "l": 4,
        "predicted_activation_allreduces": FIXME,
    }
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(cell, namespace)
    assert "[not yet]" in out.getvalue() and namespace["m"] == 2 and namespace["activation"]["per_step"] == 36
    for wrong in (32, 16, 34, 36.5, "36"):
        namespace["predicted_activation_allreduces"] = wrong
        with pytest.raises(ExerciseError) as told:
            exec(cell, namespace)
        assert "36" not in hint_of(told.value)
    solution = next(c for c in cells(SOLUTION) if c.startswith("predicted_activation_allreduces = "))
    sol_namespace = {"tp_by_hand": tp_by_hand, "LAB": SimpleNamespace(model=SimpleNamespace(num_layers=4))}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(solution, sol_namespace)
    assert sol_namespace["predicted_activation_allreduces"] == 36 and "[ok]" in out.getvalue()
    namespace["predicted_activation_allreduces"] = 36
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(cell, namespace)
    assert "[ok]" in out.getvalue() and "measured in the trace: 36 per step" in out.getvalue()


def test_notebook_05_pictures_predictions_exercises_then_the_engine():
    """The teaching order of notebook 05: a picture, a prediction, the learner's code and its check,
    then the engine's; each prediction before the job it predicts and checked after it; the hybrid
    exercise before the placement section that shows its answer. Both notebooks are valid nbformat
    and every picture they show is committed."""
    import nbformat

    for path in (NOTEBOOK, SOLUTION):
        nbformat.validate(nbformat.read(path, as_version=4))
        for image in re.findall(r"\]\(\.\./(images/[^)]+)\)", "".join(cells(path))):
            assert (REPO_ROOT / image).is_file(), image
    sources = cells(NOTEBOOK)

    def at(start: str) -> int:
        found = [i for i, c in enumerate(sources) if start in c]
        assert len(found) == 1, (start, found)
        return found[0]

    order = [
        "images/gpt/tp_mlp.png",
        "predicted_allreduces_per_layer = {",
        "%%writefile jobs/tp_mlp.py",
        "tp_by_hand.check_tp_mlp(",
        "tp_by_hand.check_layer_prediction(",
        "images/gpt/tp_block.png",
        "print(tp_communications.__doc__)",
        "predicted_activation_allreduces = FIXME",
        'tp2 = jobs.run("jobs/gpt-tp2.sbatch"',
        "tp_by_hand.check_step_prediction(",
        "images/gpt/gpipe.png",
        "def one_f_one_b(",
        "pipeline_order.check_order(",
        "inspect.getsource(pipeline_schedules.run_1f1b)",
        "predicted_bubble = {",
        'pipe_job = jobs.run("jobs/gpt-pipeline.sbatch"',
        "pipeline_order.check_bubble_prediction(",
        "mine = pipeline_order.labels(",
        "## 3. Exercise: a two-node layout from its limits",
        "hybrid_layout.check_run(",
        "## 4. Rank placement",
        "images/gpt/tp2_pp2_placement.png",
        "## Open questions",
        "## Summary",
    ]
    indices = [at(s) for s in order]
    assert indices == sorted(indices), list(zip(order, indices, strict=True))
