"""--log-straggler (Megatron's StragglerDetector): a rank made slow is named, and only while on.

``code/pretrain_gpt.py`` on 4 gloo ranks (data parallel), with a tiny model. A wrapper (``WORKER``)
makes one rank's forward-backward ``SLOW_S`` seconds longer, as a busy process beside it would; on
rank 0 it can ask the detector's control port for a toggle at a chosen iteration (``curl
rank0:PORT``). The checks: every report names the slow rank as the one of longest forward-backward
time and lowest TFLOP/s, and with ``--straggler-minmax-count 2`` it is first of the bottom two;
``--disable-straggler-on-startup`` prints nothing until the port is asked, then reports.

Without processes: the line's formatting from given per-rank values, with the GPU readings (power,
temperature, utilisation, clock, as on CUDA) and without them (the CPU line, unchanged).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from distlab import REPO_ROOT
from distlab.gpt.training import straggler
from distlab.gpt.training.straggler import STRAGGLER, STRAGGLER_RANKS, format_report, gpu_health
from distlab.local_ranks import free_port, torchrun_env
from distlab.local_runs import prepare_data

pytestmark = pytest.mark.timeout(120)

TINY = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16"
    " --micro-batch-size 1 --global-batch-size 4 --lr 1e-3 --split 90,10,0 --eval-interval 1000"
    " --eval-iters 0 --seed 5 --log-interval 2 --train-iters 8 --log-straggler"
).split()
PRETRAIN = str(REPO_ROOT / "code" / "pretrain_gpt.py")
SLOW_RANK = 2

WORKER = """
import os, runpy, sys, time, urllib.request

script = sys.argv[1]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
import distlab.gpt.pretrain as pretrain

train, log_iteration = pretrain.train, pretrain.log_iteration


def slowed_train(run, *args, **kwargs):
    if os.environ["RANK"] == os.environ["SLOW_RANK"]:
        forward_backward = run.forward_backward

        def slow(*a, **k):
            time.sleep(float(os.environ["SLOW_S"]))
            return forward_backward(*a, **k)

        run.forward_backward = slow
    return train(run, *args, **kwargs)


def log_then_toggle(run, *args):
    log_iteration(run, *args)
    if os.environ["RANK"] == "0" and run.iteration == int(os.environ.get("TOGGLE_AT", "0")):
        urllib.request.urlopen(f"http://127.0.0.1:{os.environ['PORT']}/", timeout=10).read()
        time.sleep(0.5)  # the controller thread sets the flag after answering


pretrain.train, pretrain.log_iteration = slowed_train, log_then_toggle
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=320, max_files=20).argv()


def run(tmp_path, argv: list[str], **env: str) -> str:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    port = free_port()
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("TORCHELASTIC_", "RANK"))}
    base.update(
        OMP_NUM_THREADS="1", SLOW_RANK=str(SLOW_RANK), SLOW_S="0.15", PORT=env.pop("PORT", "0"), **env
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), PRETRAIN, *argv],
            env={**base, **torchrun_env(rank, 4, port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(4)
    ]
    logs = [p.communicate(timeout=100)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[SLOW_RANK][-3000:]
    return logs[0]


def test_the_slow_rank_is_named_in_every_report(data, tmp_path):
    log = run(
        tmp_path, [*TINY, *data, "--straggler-minmax-count", "2", "--straggler-ctrlr-port", str(free_port())]
    )
    reports = STRAGGLER.parse(log)
    assert [r["iteration"] for r in reports] == [2, 4, 6, 8], log[-3000:]
    for r in reports:
        assert r["max_rank"] == SLOW_RANK and r["min_tf_rank"] == SLOW_RANK, r
        assert r["max_ms"] > r["min_ms"] + 100  # the 150 ms sleep, less the noise of 2 shared cores
    ranked = STRAGGLER_RANKS.parse(log)
    assert [(r["which"].strip(), r["n"]) for r in ranked] == [("Bottom", 2), ("Top", 2)] * 4, log[-3000:]
    bottom, top = [re.findall(r"/(\d+),", line) for line in log.splitlines() if line.startswith("^^^^")][-2:]
    assert bottom[0] == str(SLOW_RANK) and str(SLOW_RANK) not in top, (bottom, top)


def test_disabled_on_startup_until_the_port_turns_it_on(data, tmp_path):
    port = str(free_port())
    argv = [*TINY, *data, "--disable-straggler-on-startup", "--straggler-ctrlr-port", port]
    log = run(tmp_path, argv, PORT=port, TOGGLE_AT="3")
    assert "> straggler: StragglerDetector turned ON" in log, log[-3000:]
    assert [r["iteration"] for r in STRAGGLER.parse(log)] == [6, 8], log[-3000:]
    assert all(r["max_rank"] == SLOW_RANK for r in STRAGGLER.parse(log))
    assert "MnPwr/Rnk" not in log  # no GPU readings on the CPU


#: Three ranks' (Rtt ms, Etpt TF/s, rank): rank 1 is the slow one.
GATHERED = [(20.0, 3.0e-4, 0), (61.25, 1.0e-4, 1), (21.5, 2.9e-4, 2)]
CPU_LINE = (
    "> straggler: iteration 10 | MnRtt/Rnk: 20.00ms/0 | MxRtt/Rnk: 61.25ms/1"
    " | MnEtpt/Rnk: 1.000E-04TF/1 | MxEtpt/Rnk: 3.000E-04TF/0"
)


def test_the_cpu_line_is_unchanged_without_gpu_readings():
    assert gpu_health(torch.device("cpu")) is None
    lines = format_report(10, [(*g, None) for g in GATHERED], minmax_count=2)
    assert lines == [
        CPU_LINE,
        "^^^^ Bottom 2 Ranks with lowest  Etpt(TF): 1.000E-04/1, 2.900E-04/2,",
        "^^^^ Top    2 Ranks with highest Etpt(TF): 2.900E-04/2, 3.000E-04/0,",
    ]
    (read,) = STRAGGLER.parse(lines[0])
    assert "min_w" not in read and (read["max_rank"], read["min_tf_rank"]) == (1, 1)


def test_the_gpu_readings_in_megatrons_order():
    health = [
        dict(power_w=612.5, temperature_c=55.0, utilization_pct=100.0, clock_mhz=1980.0),
        dict(power_w=420.25, temperature_c=83.0, utilization_pct=97.0, clock_mhz=1410.0),
        dict(power_w=650.0, temperature_c=52.0, utilization_pct=100.0, clock_mhz=1965.0),
    ]
    (line,) = format_report(10, [(*g, h) for g, h in zip(GATHERED, health, strict=True)], minmax_count=1)
    assert line == (
        "> straggler: iteration 10 | MnRtt/Rnk: 20.00ms/0 | MxRtt/Rnk: 61.25ms/1"
        " | MnPwr/Rnk: 420.25W/1 | MxPwr/Rnk: 650.00W/2 | MnTmp/Rnk: 52.00C/2 | MxTmp/Rnk: 83.00C/1"
        " | MnUtl/Rnk: 97.00%/1 | MxUtl/Rnk: 100.00%/0 | MnClk/Rnk: 1410.00MHz/1 | MxClk/Rnk: 1980.00MHz/0"
        " | MnEtpt/Rnk: 1.000E-04TF/1 | MxEtpt/Rnk: 3.000E-04TF/0"
    )
    (read,) = STRAGGLER.parse(line)
    assert (read["min_mhz"], read["min_mhz_rank"], read["max_c_rank"]) == (1410.0, 1, 1)
    # one rank without readings (no pynvml there): the line has none
    mixed = [(*GATHERED[0], health[0]), (*GATHERED[1], None), (*GATHERED[2], health[2])]
    assert format_report(10, mixed, minmax_count=1) == [CPU_LINE]


def test_no_readings_when_pynvml_is_missing(monkeypatch):
    def missing(device=None):
        raise ModuleNotFoundError("pynvml does not seem to be installed or it can't be imported.")

    monkeypatch.setattr(straggler.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(straggler.torch.cuda, "power_draw", missing)
    assert gpu_health(torch.device("cuda", 0)) is None
    assert gpu_health(torch.device("cpu")) is None
