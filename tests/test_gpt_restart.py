"""torchrun --max-restarts: a rank killed with SIGKILL, the job restarts and resumes by itself.

Every test runs ``code/pretrain_gpt.py`` on 2 gloo ranks under ``torchrun --standalone
--max-restarts 1`` with ``--save D --load D --save-interval 3`` (torch_dist, the default; the kill
during a save in the legacy format too), pauses one rank of the first
attempt at a chosen point (after an iteration, or half-way through writing a checkpoint), kills it
with SIGKILL from here, as a user would, and checks that the second attempt says it is a restart,
resumes from the latest complete checkpoint and ends with the losses of an uninterrupted run.

The kill iteration is ``random.Random(SEED)``'s choice among the iterations after the first
checkpoint; ``DISTLAB_RESTART_SEED`` picks another one. Without a fresh namespace in torchrun's
store per attempt (``distlab.torchrun_store.agent_store_namespace``), the second attempt reads the
gloo addresses of the killed one and fails ("Connection refused") or hangs; the first test below
checks that handshake alone, in threads.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from distlab import REPO_ROOT
from distlab.local_runs import prepare_data
from distlab.torchrun_store import agent_store_namespace

pytestmark = pytest.mark.timeout(90)

SEED = int(os.environ.get("DISTLAB_RESTART_SEED", "23"))
TRAIN_ITERS, SAVE_INTERVAL = 12, 3
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32"
    " --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine"
    " --lr-warmup-fraction 0.1 --split 90,10,0 --log-interval 1 --eval-interval 1000 --eval-iters 1"
    f" --seed 5 --train-iters {TRAIN_ITERS} --save-interval {SAVE_INTERVAL}"
).split()
#: Megatron's iteration line: iteration and lm loss.
ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|", re.M)

#: Runs pretrain_gpt.py as torchrun's worker (and notes its pid in PIDS_DIR: torchrun starts
#: workers in sessions of their own, which outlive a torchrun killed on a timeout). In the first
#: attempt, the rank whose LOCAL_RANK is PAUSE_RANK stops at PAUSE_AT ("after:<iteration>": once
#: that iteration and its save are done; "saving:<iteration>": half-way through writing that
#: iteration's checkpoint), writes its pid to PAUSE_FILE and sleeps until the test kills it. With
#: LATE_LINE="<rank>:<iteration>:<seconds>", the rank whose RANK is <rank> logs that iteration's line
#: (the last rank logs them) that many seconds late in the first attempt, as a process that a loaded
#: machine did not schedule at once after the iteration's last collective.
WORKER = """
import os, runpy, sys, time

open(os.path.join(os.environ["PIDS_DIR"], str(os.getpid())), "w").close()
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))


def pause():
    with open(os.environ["PAUSE_FILE"] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.environ["PAUSE_FILE"] + ".tmp", os.environ["PAUSE_FILE"])
    time.sleep(100)
    os._exit(3)  # nobody killed us: end, never hang


if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["LOCAL_RANK"] == os.environ["PAUSE_RANK"]:
    when, iteration = os.environ["PAUSE_AT"].split(":")
    if when == "after":
        import distlab.gpt.pretrain as pretrain

        maybe_save = pretrain.maybe_save

        def maybe_save_then_pause(run):
            maybe_save(run)
            if run.iteration == int(iteration):
                pause()

        pretrain.maybe_save = maybe_save_then_pause
    else:
        import torch

        save = torch.save

        def save_half_then_pause(obj, f, *args, **kwargs):  # f: the file checkpointing opened
            if f"iter_{int(iteration):07d}.tmp" in str(getattr(f, "name", f)):
                f.write(b"half a checkpoint")
                f.flush()
                pause()
            return save(obj, f, *args, **kwargs)

        torch.save = save_half_then_pause
late_rank, _, late = os.environ.get("LATE_LINE", "").partition(":")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and late_rank == os.environ["RANK"]:
    import distlab.gpt.pretrain as pretrain

    late_at, late_s = late.split(":")
    log_iteration = pretrain.log_iteration

    def log_iteration_late(run, *args, **kwargs):
        if run.iteration == int(late_at):
            time.sleep(float(late_s))
        log_iteration(run, *args, **kwargs)

    pretrain.log_iteration = log_iteration_late
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def test_a_restarted_rank_never_joins_the_namespace_of_a_killed_attempt():
    """Attempt 1's rank 1 starts before its rank 0 and reads attempt 0's leader: it waits for the
    new one. A rank that never comes makes the other fail after the timeout, saying what it awaited."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def join(rank: int, timeout_s: float = 20) -> tuple[str, int]:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=20))
        return agent_store_namespace(dist.PrefixStore("distlab", client), rank, 2, timeout_s)

    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(join, [0, 1]))
    with ThreadPoolExecutor(2) as pool:
        late = pool.submit(join, 1)
        time.sleep(0.5)  # rank 1 has read attempt 0's leader by now
        second = [pool.submit(join, 0).result(), late.result()]
    assert first[0] == first[1] and first[0][1] == 0
    assert second[0] == second[1] and second[0][1] == 1 and second[0][0] != first[0][0]
    with pytest.raises(
        TimeoutError, match=r"rank 0 waited 1 s in torchrun's store for ranks \[1\] to join attempt 2"
    ):
        join(0, timeout_s=1)
    with pytest.raises(
        TimeoutError, match=r"rank 1 waited 1 s in torchrun's store for rank 0 .* never answered"
    ):
        join(1, timeout_s=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=80).argv()


def torchrun(
    folder: Path,
    data: list[str],
    pause_rank: int | None = None,
    pause_at: str = "",
    flags: tuple[str, ...] = (),
) -> tuple[str, int]:
    """Run the tiny job (and ``flags``) under torchrun in ``folder``; kill the paused rank, if one is
    asked to pause.

    Returns the log (all ranks, both attempts) and torchrun's exit code.
    """
    folder.mkdir(parents=True, exist_ok=True)
    worker, log_path, pid_file = folder / "worker.py", folder / "log", folder / "paused.pid"
    worker.write_text(WORKER)
    (folder / "pids").mkdir()
    ckpt = str(folder / "ckpt")
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    env.update(OMP_NUM_THREADS="1", PAUSE_FILE=str(pid_file), PAUSE_AT=pause_at, PAUSE_RANK=str(pause_rank))
    env.update(PIDS_DIR=str(folder / "pids"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", str(worker), str(REPO_ROOT / "code" / "pretrain_gpt.py")]
    cmd += [*TINY, *data, *flags, "--save", ckpt, "--load", ckpt]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 50
        if pause_rank is not None:
            while not pid_file.exists():
                assert proc.poll() is None, (
                    f"torchrun ended before a rank paused at {pause_at}:\n{log_path.read_text()}"
                )
                assert time.monotonic() < deadline, (
                    f"no rank paused at {pause_at} in 50 s:\n{log_path.read_text()}"
                )
                time.sleep(0.05)
            on_kill(folder)
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"torchrun did not end in 50 s (pause {pause_at}):\n{log_path.read_text()[-6000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_workers(folder, worker)
    return log_path.read_text(), rc


def kill_workers(folder: Path, worker: Path) -> None:
    """SIGKILL the workers of this run that are still alive (none, when torchrun ended normally)."""
    for pid_path in (folder / "pids").iterdir():
        try:
            if str(worker) in Path(f"/proc/{pid_path.name}/cmdline").read_text():
                os.kill(int(pid_path.name), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass  # ended


def on_kill(folder: Path) -> None:
    """Note in ``at_kill.json`` what the checkpoint folder holds while the paused rank waits for
    its SIGKILL: its files and the iteration that the tracker names."""
    ckpt = folder / "ckpt"
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text()
    (folder / "at_kill.json").write_text(json.dumps({"files": files, "tracker": tracker}))


def losses(log: str) -> dict[int, str]:
    """Iteration -> the lm loss of its last line in ``log`` (a restart's line replaces the killed one's)."""
    return {int(it): loss for it, loss in ITERATION.findall(log)}


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> dict[int, str]:
    log, rc = torchrun(tmp_path_factory.mktemp("uninterrupted"), data)
    assert rc == 0, log
    assert "> restart" not in log
    got = losses(log)
    assert sorted(got) == list(range(1, TRAIN_ITERS + 1)), log
    return got


def assert_resumed(log: str, rc: int, resumed_from: int, reference: dict[int, str], what: str) -> None:
    """rc 0, the restart line, the second attempt's iterations and the final losses of ``reference``."""
    assert rc == 0, f"{what}: torchrun ended with {rc}:\n{log[-6000:]}"
    line = f"> restart 1 of torchrun's --max-restarts 1: resuming from iteration {resumed_from}, the latest"
    assert line in log, f"{what}: no line {line!r} in the log:\n{log[-6000:]}"
    after = log[log.index(line) :]
    assert [int(it) for it, _ in ITERATION.findall(after)] == list(range(resumed_from + 1, TRAIN_ITERS + 1))
    got = losses(log)
    assert sorted(got) == sorted(reference), f"{what}: iterations {sorted(got)}"
    far = {it: (got[it], ref) for it, ref in reference.items() if abs(float(got[it]) - float(ref)) > 1e-6}
    assert not far, f"{what}: losses (restarted, uninterrupted) differ at {far}"


def test_sigkill_after_a_random_iteration_resumes_from_the_latest_checkpoint(data, uninterrupted, tmp_path):
    kill_at = random.Random(SEED).choice(range(SAVE_INTERVAL + 1, TRAIN_ITERS))
    resumed_from = kill_at // SAVE_INTERVAL * SAVE_INTERVAL
    log, rc = torchrun(tmp_path, data, pause_rank=1, pause_at=f"after:{kill_at}")
    what = f"rank 1 killed after iteration {kill_at} (seed {SEED})"
    assert "failed (exitcode: -9) local_rank: 1" in log, f"{what}: no SIGKILL in the log"
    assert_resumed(log, rc, resumed_from, uninterrupted, what)


#: The file rank 0 writes with torch.save in each format (torch_dist: before DCP writes the shards).
HALF_WRITTEN = {
    "torch_dist": "iter_0000006.tmp/common.pt",
    "torch": "iter_0000006.tmp/mp_rank_00/model_optim_rng.pt",
}


@pytest.mark.parametrize("fmt", list(HALF_WRITTEN))
def test_sigkill_while_saving_keeps_the_previous_checkpoint(data, uninterrupted, tmp_path, fmt):
    """Rank 0 dies half-way through its file in iter_0000006.tmp: the job resumes from 3."""
    log, rc = torchrun(tmp_path, data, pause_rank=0, pause_at="saving:6", flags=("--ckpt-format", fmt))
    at_kill = json.loads((tmp_path / "at_kill.json").read_text())
    assert at_kill["tracker"] == "3"  # the tracker still names the complete checkpoint
    assert HALF_WRITTEN[fmt] in at_kill["files"]
    assert not [p for p in at_kill["files"] if p.startswith("iter_0000006/")]
    assert_resumed(log, rc, 3, uninterrupted, "rank 0 killed while saving iteration 6")
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(TRAIN_ITERS)
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [f"iter_{i:07d}" for i in (3, 6, 9, 12)]
