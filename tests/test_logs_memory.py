"""Notebook 07's log readers and the job's cgroup peak, on lines the engine and Slurm print."""

from __future__ import annotations

import importlib.util

from distlab import REPO_ROOT
from distlab.gpt.memory.meters import format_prediction
from distlab.logs import memory
from distlab.logs.plots import memory_and_time

spec = importlib.util.spec_from_file_location("job_peak_memory", REPO_ROOT / "code" / "job_peak_memory.py")
job_peak_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(job_peak_memory)

LOG = f"""> global batch size 16 = micro batch 4 x data-parallel 1 x accumulation steps 4
{format_prediction(200 * 2**20, 210 * 2**20, "peak RSS above the 690 MiB before the model")}
 iteration        1/       2 | consumed samples:           16 | elapsed time per iteration (ms): 900.0 | learning rate: 1.000E-03 | global batch size:    16 | lm loss: 8.300000E+00 | loss scale: 4294967296.0 | number of skipped iterations:   1 | number of nan iterations:   0 |
 iteration        2/       2 | consumed samples:           32 | elapsed time per iteration (ms): 450.0 | learning rate: 0.000E+00 | global batch size:    16 | lm loss: 8.200000E+00 | loss scale: 2147483648.0 | number of skipped iterations:   1 | number of nan iterations:   0 |
job 223: peak 1116 MiB of its 1300 MiB limit (memory cgroup v1)
"""


def test_summary_reads_every_number_the_notebook_plots() -> None:
    s = memory.summary(LOG)
    assert (s["micro"], s["accumulation"], s["predicted_mib"], s["measured_mib"]) == (4, 4, 200.0, 210.0)
    assert (s["baseline_mib"], s["job_peak_mib"], s["ms"]) == (690.0, 1116.0, 450.0)
    assert s["losses"] == [8.3, 8.2] and s["scales"] == [2.0**32, 2.0**31] and s["skipped"] == [1, 1]
    assert not s["oom"]


def test_oom_lines_as_grep_finds_them() -> None:
    slurm = "slurmstepd-node1: error: Detected 1 oom-kill event(s) in StepId=224.0. Some of your processes"
    cuda = "[rank 0] > out of memory at --micro-batch-size 8 (--device-memory-gib 16): CUDA out of memory."
    assert memory.oom_lines(f"start\n{slurm}\nmiddle\n{cuda}\n") == [slurm, cuda]
    assert memory.summary(slurm)["oom"] and "predicted_mib" not in memory.summary(slurm)


def test_job_cgroup_found_for_v1_and_v2(tmp_path) -> None:
    v1 = "12:memory:/slurm_node1/uid_0/job_224/step_0/task_0\n11:cpu,cpuacct:/slurm_node1/uid_0/job_224\n"
    assert (
        job_peak_memory.job_cgroup(v1, "224").as_posix() == "/sys/fs/cgroup/memory/slurm_node1/uid_0/job_224"
    )
    v2 = "0::/system.slice/slurmstepd.scope/job_31/step_batch/user/task_0\n"
    assert (
        job_peak_memory.job_cgroup(v2, "31").as_posix()
        == "/sys/fs/cgroup/system.slice/slurmstepd.scope/job_31"
    )
    assert job_peak_memory.job_cgroup("0::/user.slice\n", "31") is None
    (tmp_path / "memory.max_usage_in_bytes").write_text(str(1116 * 2**20))
    (tmp_path / "memory.limit_in_bytes").write_text(str(1300 * 2**20))
    line = job_peak_memory.describe(tmp_path, "223")
    assert line == "job 223: peak 1116 MiB of its 1300 MiB limit (memory cgroup v1)"
    assert memory.job_peak(line) == {"peak": 1116.0, "limit": 1300.0}


def test_memory_and_time_stacks_the_parts_beside_the_time() -> None:
    rows = {
        "plain DP": {"parameters": 56.0, "optimizer state": 112.0, "ms": 900.0, "predicted": 170.0},
        "ZeRO-1": {"parameters": 56.0, "optimizer state": 56.0, "ms": 950.0, "predicted": 115.0},
    }
    parts = {"parameters": "parameters", "optimizer state": "optimizer state"}
    fig = memory_and_time(rows, parts, "MiB on rank 0", estimate="predicted", log_time=True)
    mem_ax, time_ax = fig.axes
    tops = [bar.get_y() + bar.get_height() for bar in mem_ax.patches]  # bars of the parts, in order of parts
    assert tops == [56.0, 56.0, 168.0, 112.0]
    assert list(mem_ax.lines[0].get_ydata()) == [170.0, 115.0]
    assert [t.get_text() for t in mem_ax.get_legend().get_texts()] == ["estimate", *parts]
    assert [bar.get_height() for bar in time_ax.patches] == [900.0, 950.0]
    assert [t.get_text() for t in time_ax.texts] == ["900", "950"] and time_ax.get_yscale() == "log"
