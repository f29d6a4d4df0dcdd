"""The utilisation sampler: one CSV per node, every stop condition, never outliving the job
(on the local cluster), and the plot of all nodes with the job's phases."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from distlab import REPO_ROOT, jobs
from distlab.profiling.plots import job_phases, plot_utilisation
from distlab.profiling.utilisation import read_csvs

pytestmark = pytest.mark.timeout(240)
SCRIPT = str(REPO_ROOT / "code" / "sample_utilisation.py")


def sampler(out, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, SCRIPT, "--output-dir", str(out), "--interval", "0.2", *args])


def test_rows_columns_and_max_seconds(tmp_path):
    ballast = bytearray(64 * 2**20)  # the parent's tree (this test) holds >= 64 MiB
    assert sampler(tmp_path, "--max-seconds", "1.5").wait(timeout=30) == 0
    node = read_csvs(tmp_path)
    assert len(node) == 1
    cols = next(iter(node.values()))
    cores = psutil.cpu_count()
    assert list(cols)[:3] == ["time", "node", "cpu"] and f"cpu{cores - 1}" in cols
    assert 4 <= len(cols["time"]) <= 10  # 1.5 s at 0.2 s, plus start-up jitter
    assert all(0 <= c <= 100 for c in cols["cpu"])
    assert min(cols["job_rss_mib"]) > 64 and min(cols["job_procs"]) >= 1
    del ballast


@pytest.mark.parametrize("how", ["stop file", "SIGTERM"])
def test_stops_on_request_with_a_complete_csv(tmp_path, how):
    stop = tmp_path / "STOP"
    proc = sampler(tmp_path / "csv", "--stop-file", str(stop), "--max-seconds", "120")
    time.sleep(1.5)
    stop.touch() if how == "stop file" else proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    text = next((tmp_path / "csv").glob("*.csv")).read_text()
    assert text.endswith("\n") and len(text.splitlines()) >= 3


def test_an_orphaned_sampler_stops(tmp_path):
    shell = f"{sys.executable} {SCRIPT} --output-dir {tmp_path} --interval 0.2 --max-seconds 120 & echo $!; sleep 1"
    pid = int(
        subprocess.run(["sh", "-c", shell], capture_output=True, text=True, timeout=30).stdout.split()[0]
    )
    for _ in range(50):  # its parent (the shell) has exited: the sampler must follow within a sample
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the orphaned sampler kept running")


def test_bad_interval_is_refused(tmp_path):
    out = subprocess.run([sys.executable, SCRIPT, "--output-dir", str(tmp_path), "--interval", "0"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0 and "--interval must be > 0 seconds, got 0.0" in out.stderr


SBATCH = """#!/bin/bash
#SBATCH --job-name=util-{tag}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}/%x-%j.out
source "$LAB_ROOT/sites/job-env.sh"
UTIL={out}/util
srun --overlap --ntasks-per-node=1 python $LAB_CODE/sample_utilisation.py --output-dir $UTIL \\
     --stop-file $UTIL/STOP --interval 0.25 &
sleep 2
# "training": 3 s of work holding 200 MiB on each node
srun --ntasks-per-node=1 python -c "import time; b = bytearray(200 * 2**20); t = time.time()
while time.time() - t < 3: sum(range(10000))"
sleep 1
{stop}
"""


@pytest.mark.parametrize("stop", [True, False], ids=["stop-file", "job-end"])
def test_one_csv_per_node_and_never_outliving_the_job(slurm_cluster, tmp_path, stop):
    script = tmp_path / "util.sbatch"
    script.write_text(
        SBATCH.format(tag=int(stop), out=tmp_path, stop="touch $UTIL/STOP; wait" if stop else "")
    )
    job = jobs.run(script, timeout=180)
    nodes = read_csvs(tmp_path / "util")
    assert sorted(nodes) == ["node1", "node2"], job.log()
    phases = job_phases(job.info)
    for name, cols in nodes.items():
        assert set(cols["node"]) == {name}
        assert max(cols["job_rss_mib"]) > 200, (name, max(cols["job_rss_mib"]))  # the training step's bytes
        assert phases["start"] - 1 <= cols["time"][0] and cols["time"][-1] <= phases["end"] + 2
    time.sleep(1)  # Slurm's kill of the step (job-end case) is asynchronous to the job's final state
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(tmp_path / "util") in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, f"samplers outlived job {job.id}: {left}"
    fig = plot_utilisation(nodes, phases)
    assert [ax.get_ylabel() for ax in fig.axes] == ["CPU %", "job RSS (MiB)"]
