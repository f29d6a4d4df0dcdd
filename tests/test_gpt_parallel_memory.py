"""The per-rank memory report counts what it says it counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distlab.gpt.memory.meters import format_memory, memory_report, memory_stats

pytestmark = pytest.mark.engine_fast


def test_memory_stats_after_one_adam_step() -> None:
    model = nn.Linear(10, 10)  # 110 fp32 values = 440 bytes
    opt = torch.optim.Adam(model.parameters())
    stats = memory_stats(model, opt, torch.device("cpu"))
    assert (stats["parameters"], stats["gradients"], stats["optimizer_state"]) == (440, 0, 0)
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    stats = memory_stats(model, opt, torch.device("cpu"))
    assert stats["num_parameters"] == 110
    assert stats["gradients"] == 440
    assert stats["optimizer_state"] == 2 * 440 + 2 * 4  # exp_avg, exp_avg_sq, one fp32 step per tensor
    assert stats["peak"] > 10 * 2**20 and stats["peak_kind"] == "peak RSS"  # an interpreter with torch
    line = format_memory(3, stats, " tp 1 pp 1 dp 0")
    assert line.startswith("[rank 3 tp 1 pp 1 dp 0] memory (MiB): parameters 0.00 (110 values)")
    report = memory_report(model, opt, torch.device("cpu"))  # no process group: this rank only
    assert len(report) == 1 and report[0].startswith("[rank 0] memory (MiB): parameters 0.00 (110 values)")
