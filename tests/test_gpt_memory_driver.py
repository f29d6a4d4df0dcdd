"""The driver's memory paths: the meter, the predicted-vs-measured line, the CUDA budget's
messages, and ``--deepspeed`` (ZeRO-3 through ``pretrain_gpt.py``) against the plain engine."""

from __future__ import annotations

import re

import pytest
import torch

from distlab.gpt.local_run import prepare_data, spawn_pretrain
from distlab.gpt.memory import MiB, PeakMeter, cap_device_memory, out_of_memory_message
from distlab.logs.memory import prediction

pytestmark = pytest.mark.timeout(240)


def test_cpu_meter_sees_a_tensor_allocated_after_its_start() -> None:
    meter = PeakMeter(torch.device("cpu")).start()
    block = torch.ones(64 * MiB // 4)  # 64 MiB of fp32, written, so resident
    peak, how = meter.peak()
    del block
    assert 64 * MiB <= peak < 64 * MiB + 32 * MiB and how.startswith("peak RSS above the")
    assert PeakMeter(torch.device("cpu")).start().peak()[0] < 16 * MiB  # reset: the block is gone


def test_budget_and_out_of_memory_messages() -> None:
    note = cap_device_memory(16, torch.device("cpu"))
    assert note == "> --device-memory-gib 16 caps CUDA memory only: on cpu the budget is the job's --mem"
    assert cap_device_memory(None, torch.device("cpu")) is None
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 15.78 GiB total)")
    assert out_of_memory_message(exc, 8, 16.0) == (
        "[rank 0] > out of memory at --micro-batch-size 8 (--device-memory-gib 16): "
        "CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 15.78 GiB total)"
    )
    assert "(no --device-memory-gib cap)" in out_of_memory_message(exc, 8, None)


def test_deepspeed_zero3_run_matches_the_plain_engine(tmp_path) -> None:
    data = prepare_data(tmp_path / "data", vocab_size=512, max_files=80).argv()
    argv = [*data, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
            "--lr", "3e-3", "--split", "90,10,0", "--log-interval", "1", "--eval-interval", "3",
            "--eval-iters", "1", "--seed", "5"]  # fmt: skip
    plain = spawn_pretrain(argv, 2, tmp_path / "plain")
    zero3 = spawn_pretrain([*argv, "--deepspeed", "--zero-stage", "3"], 2, tmp_path / "zero3")
    assert len(plain.last["losses"]) == 3 and plain.last["losses"][-1] < plain.last["losses"][0]
    torch.testing.assert_close(zero3.last["losses"], plain.last["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(zero3.last["val_losses"], plain.last["val_losses"], rtol=1e-5, atol=0)
    assert (
        "> deepspeed: ZeRO stage 3 | train_batch_size 8 = micro 2 x accumulation 2 x world size" in zero3.log
    )
    for run in (plain, zero3):
        found = prediction(run.log)
        assert found["predicted"] > 0 and found["measured"] > 0 and found["baseline"] > 0, run.log[-2000:]
    assert "(DeepSpeed's own buffers are not in the estimate)" in zero3.log
    # ZeRO-3: each of the 2 ranks holds half of every parameter (plus padding)
    sizes = [float(m) for m in re.findall(r"memory \(MiB\): parameters ([\d.]+)", zero3.log)]
    full = [float(m) for m in re.findall(r"memory \(MiB\): parameters ([\d.]+)", plain.log)]
    assert len(sizes) == 2 and all(abs(s - full[0] / 2) < 0.05 for s in sizes), (sizes, full)
