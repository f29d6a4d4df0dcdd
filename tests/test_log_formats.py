"""Each engine log line's one definition: its parser reads the line as the engine prints it, and
format then parse gives the same fields back."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from distlab.gpt.build import BATCH, PARAMETERS
from distlab.gpt.deepspeed.config import DEEPSPEED
from distlab.gpt.memory.meters import MEMORY, PREDICTION, RANK_COORDS, format_memory, format_prediction
from distlab.gpt.parallel_state import BANNER
from distlab.gpt.pretrain import MOE
from distlab.gpt.tensor_parallel.layers import VOCAB_PADDING
from distlab.gpt.training.log import ITERATION, VALIDATION, iteration_line, validation_lines
from distlab.log_line import LogLine

pytestmark = pytest.mark.engine_fast

# Lines as the engine printed them before the formats moved into one module (its f-strings).
ITERATION_TEXT = (
    " iteration        3/      10 | consumed samples:           24 | elapsed time per iteration (ms): 1234.6 |"
    " learning rate: 2.500E-04 | global batch size:     8 | lm loss: 7.123457E+00 | loss scale: 65536.0 |"
    " grad norm: 2.346 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    " tokens per second: 1658.9 | TFLOP/s per device: 0.012 | MFU: 3.5% |"
)
MEGATRON_TEXT = (  # Megatron-LM's own training_log line: no throughput fields
    " iteration      100/     100 | consumed samples:          800 | elapsed time per iteration (ms): 537.3 |"
    " learning rate: 5.822E-05 | global batch size:     8 | lm loss: 7.448950E+00 | loss scale: 1.0 |"
    " grad norm: 1.303 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)
MEMORY_TEXT = (
    "[rank 1 tp 1 pp 0 dp 0] memory (MiB): parameters 0.71 (185,536 values) | gradients 0.71 | "
    "optimizer state 1.42 | peak RSS 709.1"
)
PREDICTION_TEXT = (
    "> memory: predicted peak 669.1 MiB | measured 709.2 MiB (peak RSS above the 690 MiB before the model) | "
    "error +6.0%"
)
VALIDATION_TEXT = (
    " validation loss at the end of training for val data | lm loss value: 5.432100E+00 | "
    "lm loss PPL: 2.286288E+02 | "
)

# fmt: off
REAL = [  # (definition, a line as the engine prints it, its fields)
    (
        BANNER,
        "using world size: 8, data-parallel-size: 2, tensor-model-parallel size: 2, pipeline-model-parallel size: 2",
        {"world_size": 8, "dp": 2, "tp": 2, "pp": 2},
    ),
    (
        BATCH,
        "> global batch size 16 = micro batch 1 x data-parallel 4 x accumulation steps 4",
        {"global_batch": 16, "micro_batch": 1, "dp": 4, "accumulation": 4},
    ),
    (
        VOCAB_PADDING,
        "> padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)",
        {"vocab_size": 50257, "dummy": 47, "padded": 50304},
    ),
    (
        PARAMETERS,
        " > number of parameters on (tensor, pipeline) model parallel rank (0, 1): 185536",
        {"tp_rank": 0, "pp_rank": 1, "parameters": 185536},
    ),
    (RANK_COORDS, " tp 1 pp 0 dp 0", {"tp": 1, "pp": 0, "dp": 0}),
    (
        MEMORY,
        MEMORY_TEXT,
        {"rank": 1, "coords": " tp 1 pp 0 dp 0", "params_mib": 0.71, "values": 185536, "grads_mib": 0.71,
         "optim_mib": 1.42, "peak_kind": "peak RSS", "peak_mib": 709.1},
    ),
    (
        MEMORY,
        "[rank 0] memory (MiB): parameters 0.71 (185,536 values) | gradients 0.71 | optimizer state 1.42 | "
        "CUDA max allocated 709.1",
        {"rank": 0, "coords": "", "params_mib": 0.71, "values": 185536, "grads_mib": 0.71, "optim_mib": 1.42,
         "peak_kind": "CUDA max allocated", "peak_mib": 709.1},
    ),
    (
        PREDICTION,
        PREDICTION_TEXT,
        {"predicted": 669.1, "measured": 709.2, "how": "peak RSS", "baseline": 690.0, "error": 6.0},
    ),
    (
        PREDICTION,
        "> memory: predicted peak 100.0 MiB | measured 110.0 MiB (peak RSS above baseline) | error +10.0%",
        {"predicted": 100.0, "measured": 110.0, "how": "peak RSS above baseline", "error": 10.0},
    ),
    (
        DEEPSPEED,
        "> deepspeed: ZeRO stage 3, offload optimizer and param to cpu | train_batch_size 8 = micro 2 x "
        "accumulation 2 x world size",
        {"stage": 3, "offload": "optimizer and param", "train_batch_size": 8, "micro_batch": 2,
         "accumulation": 2},
    ),
    (
        DEEPSPEED,
        "> deepspeed: ZeRO stage 1 | train_batch_size 4 = micro 2 x accumulation 1 x world size",
        {"stage": 1, "train_batch_size": 4, "micro_batch": 2, "accumulation": 1},
    ),
    (
        ITERATION,
        ITERATION_TEXT,
        {"it": 3, "total": 10, "samples": 24, "ms": 1234.6, "lr": 2.5e-4, "gbs": 8, "loss": 7.123457,
         "scale": 65536.0, "gnorm": 2.346, "skipped": 0, "nan": 0, "tokens_per_s": 1658.9, "tflops": 0.012,
         "mfu_percent": 3.5},
    ),
    (
        ITERATION,
        MEGATRON_TEXT,
        {"it": 100, "total": 100, "samples": 800, "ms": 537.3, "lr": 5.822e-05, "gbs": 8, "loss": 7.44895,
         "scale": 1.0, "gnorm": 1.303, "skipped": 0, "nan": 0},
    ),
    (
        VALIDATION,
        VALIDATION_TEXT,
        {"label": "the end of training for val data", "loss": 5.4321, "ppl": 228.6288},
    ),
    (
        MOE,
        " [moe] iteration 2 | layer 0 | load_balancing_loss: 1.011681 | dropped tokens: 0 | "
        "tokens per expert: 66 34 84 72 |",
        {"it": 2, "layer": 0, "aux": 1.011681, "dropped": 0, "counts": "66 34 84 72"},
    ),
]
# fmt: on


@pytest.mark.parametrize(("line", "text", "fields"), REAL)
def test_parser_reads_the_engines_line_and_format_prints_it_back(line: LogLine, text: str, fields: dict):
    assert line.parse(f"job 7 on node1\n{text}\n{text}\nnext line") == [fields, fields]
    assert line.format(**fields) == text


# fmt: off
ROUND_TRIPS = [  # chosen values, exact at the printed precision; widths overflowed, optional parts left out
    (BANNER, {"world_size": 64, "dp": 4, "tp": 8, "pp": 2}),
    (BATCH, {"global_batch": 1024, "micro_batch": 2, "dp": 64, "accumulation": 8}),
    (VOCAB_PADDING, {"vocab_size": 50257, "dummy": 1199, "padded": 51456}),
    (PARAMETERS, {"tp_rank": 7, "pp_rank": 3, "parameters": 1_234_567_890}),
    (RANK_COORDS, {"tp": 12, "pp": 0, "dp": 345}),
    (MEMORY, {"rank": 1023, "coords": " tp 3 pp 7 dp 31", "params_mib": 12345.25, "values": 3_236_495_360,
              "grads_mib": 0.0, "optim_mib": 24690.5, "peak_kind": "CUDA max allocated", "peak_mib": 65432.5}),
    (PREDICTION, {"predicted": 1000.0, "measured": 955.0, "how": "CUDA max allocated", "baseline": 12.0,
                  "error": -4.5}),
    (DEEPSPEED, {"stage": 2, "offload": "optimizer", "train_batch_size": 512, "micro_batch": 4,
                 "accumulation": 16}),
    (ITERATION, {"it": 123456789, "total": 123456789, "samples": 1_234_567_890_123, "ms": 98765.5, "lr": 1.25e-4,
                 "gbs": 1_048_576, "loss": 10.5, "scale": 4294967296.0, "gnorm": 0.25, "skipped": 1234, "nan": 0,
                 "tokens_per_s": 15234.5, "tflops": 0.125, "mfu_percent": 45.5}),
    (ITERATION, {"it": 7, "total": 10, "samples": 14, "ms": 3.5, "lr": 0.0, "gbs": 2, "loss": 2.5e-3,
                 "scale": 1.0, "skipped": 1, "nan": 0}),
    (VALIDATION, {"label": "iteration 10 | val", "loss": 4.5, "ppl": 90.0}),
    (MOE, {"it": 1000000, "layer": 95, "aux": 7.875, "dropped": 123456, "counts": " ".join(["4096"] * 64)}),
]
# fmt: on


@pytest.mark.parametrize(("line", "fields"), ROUND_TRIPS)
def test_format_then_parse_gives_the_same_typed_fields(line: LogLine, fields: dict):
    (parsed,) = line.parse(line.format(**fields))
    assert parsed == fields
    assert {k: type(v) for k, v in parsed.items()} == {k: type(v) for k, v in fields.items()}


def test_nan_and_infinity_read_back():
    fields = {"it": 3, "total": 10, "samples": 6, "ms": 1.0, "lr": 0.0, "gbs": 2, "loss": math.nan,
              "scale": 65536.0, "gnorm": math.inf, "skipped": 1, "nan": 1}  # fmt: skip
    text = ITERATION.format(**fields)
    assert "lm loss: NAN |" in text and "grad norm: inf |" in text
    (parsed,) = ITERATION.parse(text)
    assert math.isnan(parsed.pop("loss")) and parsed == {k: v for k, v in fields.items() if k != "loss"}
    assert VALIDATION.search(VALIDATION.format(label="x", loss=800.0, ppl=math.inf))["ppl"] == math.inf


def test_a_line_the_engine_extends_still_parses():
    text = PREDICTION_TEXT + " (DeepSpeed's own buffers are not in the estimate)"
    assert PREDICTION.search(text)["baseline"] == 690.0
    assert PREDICTION.search("no such line") is None and PREDICTION.parse("") == []


def test_the_engines_printers_print_the_real_lines():
    assert iteration_line(iteration=3, train_iters=10, consumed_samples=24, elapsed_ms=1234.56, lr=2.5e-4,
                          global_batch_size=8, loss=7.1234567, loss_scale=65536.0, grad_norm=2.3456, skipped=0,
                          nan=0, tokens_per_s=1658.9, tflops_per_device=0.0123, mfu=0.0345) == ITERATION_TEXT  # fmt: skip
    assert validation_lines("the end of training for val data", 5.4321)[1] == VALIDATION_TEXT
    stats = {"parameters": 4 * 185536, "gradients": 4 * 185536, "optimizer_state": 8 * 185536,
             "peak": 709 * 2**20 + 123456, "peak_kind": "peak RSS", "num_parameters": 185536}  # fmt: skip
    assert format_memory(1, stats, RANK_COORDS.format(tp=1, pp=0, dp=0)) == MEMORY_TEXT
    how = "peak RSS above the 690 MiB before the model"
    assert format_prediction(669.1 * 2**20, 709.2 * 2**20, how) == PREDICTION_TEXT


def test_format_refuses_unknown_fields_and_templates_it_cannot_read_back():
    with pytest.raises(TypeError, match="no field"):
        BATCH.format(global_batch=8, micro_batch=1, dp=8, accumulation=1, accumulation_steps=1)
    with pytest.raises(ValueError, match="reads back only"):
        LogLine("share {x:.1%}")


def test_log_lines_import_without_torch():
    code = "import sys, distlab.log_line; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
