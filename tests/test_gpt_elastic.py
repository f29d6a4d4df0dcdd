"""torchrun --nnodes=1:2: a node lost (its agent and workers killed), the other goes on alone.

Two torchrun agents on this machine, 2 gloo workers each, meet in a c10d rendezvous (the first
hosts the store: ``is_host``) and train ``code/pretrain_gpt.py`` as a world of 4 with
``--global-batch-size 8`` (micro batch 2, data-parallel 4, accumulation 1), checkpointing every 3
iterations. The second agent's local rank 0 pauses after iteration 5 (``WORKER`` of
test_gpt_restart), every rank then waits in iteration 6, and the test kills that agent and its
workers with SIGKILL, as a lost node. The first agent must restart its workers as a world of 2
(data-parallel 2, accumulation 2: the same global batch), resume from iteration 3 and finish, the
recomputed iterations with the losses of the world of 4.

The kill is armed on two events, never on a time: the pause, and iteration 5's line in the log. The
pause alone does not say that the line is there: the last rank prints it (rank 3, the second agent's
local rank 1 when the rendezvous, which orders the agents by pid, makes the second agent group rank 1)
after the iteration's last collective, unordered with the paused rank, and a loaded machine may not
have run it yet when the pause shows (a clean clone's CI once got the losses of iterations 1 to 4
only; on the first agent, that agent stops it when its other rank fails in iteration 6).
``LATE_LINE`` makes rank 3 print that line a second late in every run, so that a kill armed on the
pause alone fails here every time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlab import REPO_ROOT
from distlab.local_ranks import free_port
from distlab.local_runs import prepare_data
from distlab.logs import restarts
from tests.test_gpt_restart import WORKER, kill_workers

pytestmark = pytest.mark.timeout(300)

TRAIN_ITERS, SAVE_INTERVAL, PAUSE_AFTER = 12, 3, 5
WORLD, LATE_LINE_S = 4, 1.0
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32"
    " --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine"
    " --lr-warmup-fraction 0.1 --split 90,10,0 --log-interval 1 --eval-interval 1000 --eval-iters 1"
    f" --seed 5 --train-iters {TRAIN_ITERS} --save-interval {SAVE_INTERVAL} --attention-dropout 0 --hidden-dropout 0"
).split()
#: A dead agent is dropped after 3 missed heartbeats 1 s apart; a round of fewer than 2 waits 2 s.
START_TO_END_S = 240  # the whole run; it took 68 s at load 25 and failed a 60 s guard at load 10-14
RDZV = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,join_timeout=30"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=80).argv()


def agent(
    folder: Path, port: int, host: bool, ckpt: Path, data: list[str], log, pause: bool
) -> subprocess.Popen:
    """One node's torchrun agent (2 workers), in a session of its own; its workers note their pids."""
    (folder / "pids").mkdir(parents=True)
    (folder / "worker.py").write_text(WORKER)
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    env.update(OMP_NUM_THREADS="1", PIDS_DIR=str(folder / "pids"), PAUSE_FILE=str(folder / "paused.pid"))
    env.update(PAUSE_RANK="0" if pause else "none", PAUSE_AT=f"after:{PAUSE_AFTER}")
    env.update(LATE_LINE=f"{WORLD - 1}:{PAUSE_AFTER}:{LATE_LINE_S}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2"]
    cmd += ["--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    cmd += [f"--rdzv-conf={RDZV},is_host={int(host)}", "--rdzv-id=elastic-test"]
    cmd += [str(folder / "worker.py"), str(REPO_ROOT / "code" / "pretrain_gpt.py"), *TINY, *data]
    cmd += ["--save", str(ckpt), "--load", str(ckpt)]
    return subprocess.Popen(
        cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def logged(log_path: Path, iteration: int) -> bool:
    """Whether the log holds the whole line of ``iteration`` (its loss), read as the checks read it."""
    return any(iteration in attempt.losses for attempt in restarts.attempts(log_path.read_text()))


def test_a_lost_node_leaves_a_world_of_two_that_resumes_with_the_same_global_batch(data, tmp_path):
    ckpt, log_path = tmp_path / "ckpt", tmp_path / "log"
    port = free_port()
    with open(log_path, "ab") as log:  # both agents append whole lines to one log, as in a Slurm job
        first = agent(tmp_path / "node1", port, True, ckpt, data, log, pause=False)
        second = agent(tmp_path / "node2", port, False, ckpt, data, log, pause=True)
    agents = {"node1": first, "node2": second}
    try:
        # a hang guard, not a measured time: the run asserts its outcome (layouts, losses, tracker). At
        # load 10-14 on the 2 shared cores it had reached iteration 7 of 12 of its second attempt when
        # 60 s were up (4 ranks importing torch, then 2 again after the rendezvous); see START_TO_END_S
        deadline = time.monotonic() + START_TO_END_S
        paused = tmp_path / "node2" / "paused.pid"
        # no rank passes iteration 6 while one is paused (its all-reduces wait for it): once the pause
        # and iteration 5's line are both there, the first attempt has logged 1 to 5 and no more
        while not (paused.exists() and logged(log_path, PAUSE_AFTER)):
            assert first.poll() is None and second.poll() is None, f"an agent ended:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, (
                f"no pause after iteration {PAUSE_AFTER}, or no line of it:\n{log_path.read_text()}"
            )
            time.sleep(0.05)
        # nothing moves until the kill: the latest checkpoint now is the one the world of 2 resumes from
        tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text()
        os.kill(second.pid, signal.SIGKILL)  # the node: its agent, then its workers
        kill_workers(tmp_path / "node2", tmp_path / "node2" / "worker.py")
        second.wait()
        rc = first.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the surviving agent did not end in {START_TO_END_S} s:\n{log_path.read_text()[-6000:]}")
    finally:
        for name, proc in agents.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            kill_workers(tmp_path / name, tmp_path / name / "worker.py")
    log = log_path.read_text()
    assert rc == 0, f"the surviving agent ended with {rc}:\n{log[-6000:]}"
    assert tracker == str(SAVE_INTERVAL * (PAUSE_AFTER // SAVE_INTERVAL)) == "3"
    runs = restarts.attempts(log)
    layouts = [(a.world_size, a.dp, a.accumulation) for a in runs]
    assert layouts == [(4, 4, 1), (2, 2, 2)], f"layouts {layouts}:\n{log[-6000:]}"
    before, after = runs
    assert after.resumed_from == 3 and after.restart == 1
    assert sorted(after.losses) == list(range(4, TRAIN_ITERS + 1))
    assert sorted(before.losses) == list(range(1, PAUSE_AFTER + 1))
    recomputed = {it: (before.losses[it], after.losses[it]) for it in (4, 5)}
    assert all(abs(a - b) <= 1e-5 for a, b in recomputed.values()), f"world 4 vs world 2: {recomputed}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(TRAIN_ITERS)
