"""--log-straggler (Megatron's StragglerDetector): a rank made slow is named, and only while on.

``code/pretrain_gpt.py`` on 4 gloo ranks (data parallel), with a tiny model. A wrapper (``WORKER``)
makes one rank's forward-backward ``SLOW_S`` seconds longer, as a busy process beside it would; on
rank 0 it can ask the detector's control port for a toggle at a chosen iteration (``curl
rank0:PORT``). The checks: every report names the slow rank as the one of longest forward-backward
time and lowest TFLOP/s, and with ``--straggler-minmax-count 2`` it is first of the bottom two;
``--disable-straggler-on-startup`` prints nothing until the port is asked, then reports.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from distlab import REPO_ROOT
from distlab.gpt.training.straggler import STRAGGLER, STRAGGLER_RANKS
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
