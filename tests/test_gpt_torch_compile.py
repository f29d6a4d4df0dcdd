"""``--torch-compile`` (``native/torch_compile.py``): compiled blocks train to the eager losses.

The tiny GPT (2 blocks) trains 4 iterations on 2 gloo ranks (data parallel), eager and with every
block compiled by inductor, on the same batches. Inductor generates its own C++ loops for the
LayerNorms, the GeLU and the residual additions (the GEMMs and the attention stay ATen's); on this
CPU their fp32 results, and so the losses, were equal to the bit at this width. A vectorised loop
that sums a row in another order moves the last bits, and the steps carry that forward (the
benchmark measured 8e-6 after 13 steps at hidden 256): asserted within the course's fp32 bar, 1e-6
relative, for this tiny 4-step run, where the two were found equal.
The end-of-run line times the first iteration (tracing and code generation) and the steady state;
the first is the longer one (a compile takes seconds, a tiny iteration milliseconds; asserted: twice
as long at least, a margin over the noise of a shared machine).
"""

from __future__ import annotations

import pytest
import torch

from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.native.torch_compile import COMPILE
from distlab.local_runs import prepare_data, spawn_pretrain
from tests.test_gpt_training import TINY

pytestmark = pytest.mark.timeout(240)
STEPS = ["--global-batch-size", "4", "--train-iters", "4", "--lr-decay-iters", "4", "--eval-iters", "0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("compile")
    argv = [*TINY, *prepare_data(root / "data", vocab_size=512, max_files=80).argv(), *STEPS]
    return {
        "eager": spawn_pretrain(argv, 2, root / "eager"),
        "compiled": spawn_pretrain([*argv, "--torch-compile"], 2, root / "compiled"),
    }


def test_compiled_losses_equal_eager(runs) -> None:
    eager, compiled = (torch.tensor(runs[name].last["losses"]) for name in ("eager", "compiled"))
    assert len(compiled) == 4
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)


def test_the_log_says_what_was_compiled_and_how_long_it_took(runs) -> None:
    log = runs["compiled"].log
    assert "> torch.compile: each of the 2 blocks compiled (inductor, one graph for all)" in log
    (line,) = COMPILE.parse(log)
    assert line["n"] == 3
    assert line["first_ms"] > 2 * line["steady_ms"] > 0
    assert not COMPILE.parse(runs["eager"].log)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA inductor writes Triton, no C++ compiler needed"
)
def test_a_missing_compiler_is_refused_before_compute(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "no-such-c++")
    args = parse_args(
        [*TINY, "--data-path", "d", "--vocab-file", "v", "--merge-file", "m", *STEPS, "--torch-compile"]
    )
    with pytest.raises(ValueError, match="--torch-compile on a CPU needs a C\\+\\+ compiler") as err:
        validate_args(args, 2)
    assert "'no-such-c++' is not on PATH: install g++" in str(err.value)
