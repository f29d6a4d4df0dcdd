"""--exit-signal-handler and the hang report: a signal to one rank, a rank that stops answering.

Every run is ``code/pretrain_gpt.py`` on 2 gloo ranks with a tiny model. A small wrapper
(``WORKER``) lets one rank act at the end of a chosen iteration, as a user or Slurm would from
outside, but at a known point: send SIGUSR1 to itself, to torchrun (its parent), or stop itself
with SIGSTOP. The checks:

* one rank signalled: every rank stops at that iteration, the checkpoint is that iteration, the
  run exits 0 and says so; resumed with ``--load``, it ends with the uninterrupted run's losses;
* torchrun signalled (``--signals-to-handle ...,SIGUSR1``): it forwards the signal, the workers save
  and end, and the checkpoint resumes to the same losses (torchrun itself ends with 1);
* a rank stopped (rank 0 or another, TP 2 x PP 2): the others wait ``--distributed-timeout-minutes``
  in their collectives, dump their flight records, name the stopped rank and the collective it did
  not join, and fail, instead of hanging for PyTorch's 30 minutes; ``torchfrtrace`` reads the dumps.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from distlab import REPO_ROOT, fault_agent, faults
from distlab.checks import ExerciseError
from distlab.gpt.arguments import parse_args, validate_args
from distlab.gpt.build import BATCH
from distlab.gpt.checkpointing.checkpointer import SAVED
from distlab.gpt.checkpointing.checkpointing import resume_line
from distlab.gpt.pretrain import EXIT_SIGNAL, HANG
from distlab.gpt.training.fault_handling import ExitSignal, is_hang
from distlab.gpt.training.log import ITERATION
from distlab.local_ranks import free_port, torchrun_env
from distlab.local_runs import prepare_data
from distlab.logs import restarts
from distlab.logs.megatron import banner_line

pytestmark = pytest.mark.timeout(120)

TRAIN_ITERS, SIGNAL_AT = 12, 7
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32"
    " --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine"
    " --lr-warmup-fraction 0.1 --split 90,10,0 --log-interval 1 --eval-interval 1000 --eval-iters 1"
    f" --seed 5 --train-iters {TRAIN_ITERS}"
).split()
PRETRAIN = str(REPO_ROOT / "code" / "pretrain_gpt.py")

#: pretrain_gpt.py, where the rank whose RANK is ACT_RANK does ACT ("usr1": SIGUSR1 to itself;
#: "usr1-parent": to torchrun; "stop": SIGSTOP to itself) after iteration ACT_AT and its save, or
#: ("slow-build") takes ACT_AT seconds longer than the others to build its run.
WORKER = """
import os, runpy, signal, sys, time

script = sys.argv[1]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
if os.environ.get("RANK") == os.environ["ACT_RANK"] and os.environ["ACT"] == "slow-build":
    import distlab.gpt.pretrain as pretrain

    build_run = pretrain.build_run

    def slow_build_run(*args):
        run = build_run(*args)
        time.sleep(float(os.environ["ACT_AT"]))
        return run

    pretrain.build_run = slow_build_run
elif os.environ.get("RANK") == os.environ["ACT_RANK"]:
    import distlab.gpt.pretrain as pretrain

    maybe_save = pretrain.maybe_save

    def maybe_save_then_act(run):
        maybe_save(run)
        if run.iteration == int(os.environ["ACT_AT"]):
            act = os.environ["ACT"]
            if act == "stop":
                with open(os.environ["ACT_FILE"], "w") as f:
                    f.write(str(os.getpid()))
            pid = os.getppid() if act == "usr1-parent" else os.getpid()
            os.kill(pid, signal.SIGSTOP if act == "stop" else signal.SIGUSR1)

    pretrain.maybe_save = maybe_save_then_act
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_data(tmp_path_factory.mktemp("gptdata"), vocab_size=512, max_files=80).argv()


def clean_env(**extra: str) -> dict[str, str]:
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    return {**env, "OMP_NUM_THREADS": "1", "ACT_RANK": "-1", "ACT_AT": "0", "ACT": "", **extra}


def torchrun(folder: Path, argv: list[str], *launcher: str, **act: str) -> tuple[str, int]:
    """``torchrun --standalone`` of 2 ranks through ``WORKER``; the log and torchrun's exit code."""
    folder.mkdir(parents=True, exist_ok=True)
    worker = folder / "worker.py"
    worker.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *launcher]
    cmd += [str(worker), PRETRAIN, *argv]
    out = subprocess.run(cmd, cwd=folder, env=clean_env(**act), capture_output=True, text=True, timeout=90)
    return out.stdout + out.stderr, out.returncode


def losses(log: str) -> dict[int, float]:
    return {r["it"]: r["loss"] for r in ITERATION.parse(log)}


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory) -> dict[int, float]:
    log, rc = torchrun(tmp_path_factory.mktemp("uninterrupted"), [*TINY, *data])
    assert rc == 0, log[-4000:]
    got = losses(log)
    assert sorted(got) == list(range(1, TRAIN_ITERS + 1)), log[-4000:]
    return got


def resume_and_compare(folder: Path, data: list[str], ckpt: str, stopped_at: int, reference: dict) -> None:
    """A second run with --load resumes after ``stopped_at`` and ends with ``reference``'s losses."""
    log, rc = torchrun(folder / "resumed", [*TINY, *data, "--load", ckpt, "--save", ckpt])
    assert rc == 0, log[-4000:]
    assert f"> loaded checkpoint from {ckpt} at iteration {stopped_at}" in log
    got = losses(log)
    assert sorted(got) == list(range(stopped_at + 1, TRAIN_ITERS + 1))
    far = {it: (got[it], reference[it]) for it in got if abs(got[it] - reference[it]) > 1e-6}
    assert not far, f"losses (resumed, uninterrupted) differ at {far}"


def test_exit_signal_arguments():
    args = parse_args(
        [*TINY, "--exit-signal", "SIGUSR1", "--data-path", "x", "--vocab-file", "x", "--merge-file", "x"]
    )
    with pytest.raises(ValueError, match="--exit-signal SIGUSR1 was given without --exit-signal-handler"):
        validate_args(args, 1)
    with pytest.raises(SystemExit):  # argparse: not one of Megatron's four
        parse_args([*TINY, "--exit-signal-handler", "--exit-signal", "SIGKILL"])
    assert parse_args(TINY).exit_signal == "SIGTERM" and not parse_args(TINY).exit_signal_handler


def test_exit_signal_only_sets_a_flag_and_gives_the_signal_back():
    before = signal.getsignal(signal.SIGUSR2)
    handler = ExitSignal("SIGUSR2").install()
    os.kill(os.getpid(), signal.SIGUSR2)
    time.sleep(0.01)  # Python runs handlers between bytecodes
    assert handler.received
    handler.release()
    assert signal.getsignal(signal.SIGUSR2) == before
    with pytest.raises(ValueError, match="choose one of SIGTERM, SIGINT, SIGUSR1, SIGUSR2"):
        ExitSignal("SIGKILL")


def test_sigusr1_to_one_rank_saves_that_iteration_everywhere_and_exits_0(data, uninterrupted, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = [*TINY, *data, "--save", ckpt, "--load", ckpt, "--save-interval", "5"]
    argv += ["--exit-signal-handler", "--exit-signal", "SIGUSR1"]
    log, rc = torchrun(tmp_path / "signalled", argv, ACT_RANK="1", ACT_AT=str(SIGNAL_AT), ACT="usr1")
    assert rc == 0, log[-4000:]
    assert EXIT_SIGNAL.parse(log) == [{"signal": "SIGUSR1", "iteration": SIGNAL_AT}]
    assert sorted(losses(log)) == list(range(1, SIGNAL_AT + 1)), (
        "every rank stopped at the signalled iteration"
    )
    assert (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text() == str(SIGNAL_AT)
    assert log.index(f"saved checkpoint at iteration {SIGNAL_AT:7d}") < log.index("exiting program after")
    resume_and_compare(tmp_path, data, ckpt, SIGNAL_AT, uninterrupted)


def test_sigusr1_to_torchrun_is_forwarded_and_the_run_resumes(data, uninterrupted, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = [*TINY, *data, "--save", ckpt, "--load", ckpt, "--exit-signal-handler", "--exit-signal", "SIGUSR1"]
    handle = ("--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    log, rc = torchrun(tmp_path / "signalled", argv, *handle, ACT_RANK="0", ACT_AT="3", ACT="usr1-parent")
    assert "Received 10 death signal, shutting down workers" in log, log[-4000:]
    assert rc != 0  # torchrun re-raises the signal it handled (SignalException)
    (stop,) = EXIT_SIGNAL.parse(log)
    assert 3 <= stop["iteration"] < TRAIN_ITERS, log[-4000:]
    assert (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text() == str(stop["iteration"])
    resume_and_compare(tmp_path, data, ckpt, stop["iteration"], uninterrupted)


@pytest.mark.mostly_waits  # a rank sleeps 10 s before its first collective
def test_a_slow_start_is_not_a_hang(data, tmp_path):
    """One rank builds its run 10 s after the other, with a 6 s --distributed-timeout-minutes:
    the first collective after building waits for it (the groups' start-up timeout,
    ``STARTUP_TIMEOUT_S``), and the run trains to the end. Under load a rank's start once took
    12 s longer than another's, and the all-gather after building timed out as a hang."""
    argv = [*TINY, *data, "--distributed-timeout-minutes", "0.1"]
    log, rc = torchrun(tmp_path, argv, ACT_RANK="1", ACT_AT="10", ACT="slow-build")
    assert rc == 0 and "> hang" not in log, log[-4000:]
    assert sorted(losses(log)) == list(range(1, TRAIN_ITERS + 1)), log[-4000:]


@pytest.mark.mostly_waits  # the others wait out the 6 s timeout and the dumps' grace
@pytest.mark.parametrize("frozen", [0, 3])
def test_a_stopped_rank_and_its_collective_are_named_after_the_timeout(data, tmp_path, frozen):
    """TP 2 x PP 2: one rank stops itself (SIGSTOP) after iteration 3, rank 0 included (it serves
    the rendezvous store, and ``monitored_barrier`` cannot name it). Every other rank waits 6 s in its
    collective, dumps its flight record and, within the timeout + 30 s, names the stopped rank,
    the collective it did not join and its node, then fails. PyTorch's own analyzer reads the dumps."""
    worker, pid_file, dumps = tmp_path / "worker.py", tmp_path / "stopped.pid", tmp_path / "fr"
    worker.write_text(WORKER)
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    argv = [*TINY, *data, *layout, "--distributed-timeout-minutes", "0.1", "--train-iters", "200"]
    act = dict(ACT_RANK=str(frozen), ACT_AT="3", ACT="stop", ACT_FILE=str(pid_file))
    env = clean_env(**act, TORCH_FR_DUMP_TEMP_FILE=str(dumps / "rank_"))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), PRETRAIN, *argv],
            env={**env, **torchrun_env(rank, 4, port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(4)
    ]
    logs = {}
    try:
        for rank in sorted(set(range(4)) - {frozen}):
            logs[rank], _ = procs[rank].communicate(timeout=100)
        waited = time.time() - pid_file.stat().st_mtime
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for rank, log in logs.items():
        assert procs[rank].returncode != 0, log[-3000:]
        assert "Timed out waiting 6000ms" in log, log[-4000:]
        assert HANG.parse(log) == [{"iteration": 4, "timeout_s": 6.0, "ranks": str(frozen)}], log[-4000:]
        assert (
            f"rank {frozen} on {socket.gethostname()} (pid {pid_file.read_text()}): wrote no flight record"
            in log
        )
    report = "".join(logs.values())
    missed = re.findall(
        rf"> hang: ranks \[{frozen}\] did not join (.+?) of group \S+ \((\w+)\) \[([\d, ]+)\]", report
    )
    assert missed and all(str(frozen) in members.split(", ") for *_, members in missed), report[-4000:]
    assert 6 <= waited < 6 + 30, f"the survivors ended {waited:.0f} s after rank {frozen} stopped"
    analyzer = subprocess.run(
        [str(Path(sys.executable).with_name("torchfrtrace")), str(dumps)], capture_output=True, text=True
    )
    assert f"Missing dump files from ranks {{{frozen}}}" in analyzer.stderr, analyzer.stderr[-3000:]
    diagnosis = subprocess.run(
        [sys.executable, str(REPO_ROOT / "code" / "diagnose_hang.py"), str(dumps)],
        capture_output=True,
        text=True,
    )
    assert f"no dump from ranks {{{frozen}}}: " in diagnosis.stdout, diagnosis.stdout + diagnosis.stderr
    assert f"3 of 4 ranks wrote a flight record in {dumps}" in diagnosis.stdout
    assert f"> hang: ranks [{frozen}] did not join" in diagnosis.stdout, diagnosis.stdout + diagnosis.stderr


# --- reading a restarted run's log (distlab.logs.restarts) and the checkpoint interval (distlab.faults) ---


def attempt_log(
    first: int, last: int, resume: str, saves=(), stop: int | None = None, shift: float = 0.0, world: int = 4
) -> str:
    """One attempt as the engine prints it: banner, batch, resume line, iteration and save lines
    (global batch 8, micro batch 2, ``world`` data-parallel ranks)."""
    batch = BATCH.format(global_batch=8, micro_batch=2, dp=world, accumulation=8 // (2 * world))
    lines = [banner_line(world), batch, resume]
    for it in range(first, last + 1):
        lines.append(ITERATION.format(it=it, total=20, samples=8 * it, ms=30.0, lr=1e-3, gbs=8,
                                      loss=7.0 - it / 10 + shift, scale=1.0, skipped=0, nan=0))  # fmt: skip
        if it in saves:
            lines.append(
                SAVED.format(iteration=it, folder="ck", format="torch", blocking_ms=5.0, total_ms=6.0)
            )
    if stop is not None:
        lines.append(EXIT_SIGNAL.format(signal="SIGUSR1", iteration=stop))
    return "\n".join(lines) + "\n"


def resume(iteration: int | None, restart: int = 0) -> str:
    return resume_line("ck", iteration, SimpleNamespace(restart=restart, max_restarts=1))


REFERENCE = restarts.final_losses(attempt_log(1, 20, resume(None), saves=(5, 10, 15, 20)))
SURVIVED = attempt_log(1, 13, resume(None), saves=(5, 10)) + attempt_log(
    11, 20, resume(10, 1), saves=(15, 20)
)


def test_attempts_of_a_restarted_and_of_a_requeued_run():
    first, second = restarts.attempts(SURVIVED)
    assert (first.resumed_from, first.restart, first.last, first.saved) == (0, 0, 13, [5, 10])
    assert (second.resumed_from, second.restart, second.last, second.save_ms) == (10, 1, 20, [6.0, 6.0])
    assert (
        restarts.final_losses(SURVIVED) == REFERENCE and restarts.largest_difference(SURVIVED, REFERENCE) == 0
    )
    requeued = attempt_log(1, 7, resume(None), saves=(5, 7), stop=7) + attempt_log(
        8, 20, resume(7), saves=(10,)
    )
    stopped, resumed = restarts.attempts(requeued)
    assert (stopped.exit_signal, resumed.resumed_from, resumed.restart) == (7, 7, 0)
    hang = HANG.format(iteration=4, timeout_s=6.0, ranks="1, 3")
    assert restarts.hang_report(f"x\n{hang}\n") == {"iteration": 4, "timeout_s": 6.0, "ranks": [1, 3]}


def test_the_layout_of_each_attempt_of_an_elastic_run():
    """A node lost under --nnodes=1:2: world 4 -> 2, the same global batch from twice the accumulation."""
    elastic = attempt_log(1, 13, resume(None), saves=(5, 10)) + attempt_log(11, 20, resume(10, 1), world=2)
    layouts = [(a.world_size, a.dp, a.accumulation, a.resumed_from) for a in restarts.attempts(elastic)]
    assert layouts == [(4, 4, 1, 0), (2, 2, 2, 10)]
    died_early = "using world size" + elastic.split("using world size")[1].split("> global batch")[0]
    assert [(a.world_size, a.accumulation) for a in restarts.attempts(died_early)] == [(4, 0)]


def test_exercise_check_passes_only_a_run_that_resumed_from_a_recent_checkpoint(capsys):
    assert restarts.check_survived(None, REFERENCE, max_interval=5) is False
    assert "[not yet]" in capsys.readouterr().out
    assert restarts.check_survived(SURVIVED, REFERENCE, max_interval=5)
    died = attempt_log(1, 13, resume(None), saves=(5, 10))  # --max-restarts 0: the job failed
    scratch = died + attempt_log(1, 20, resume(None, 1), saves=(5, 10, 15, 20))  # --load elsewhere
    no_load = died + attempt_log(1, 20, "", saves=(5, 10, 15, 20))  # no --load: no resume line at all
    rare = attempt_log(1, 13, resume(None), saves=(10,)) + attempt_log(11, 20, resume(10, 1), saves=(20,))
    drift = attempt_log(1, 13, resume(None), saves=(5, 10)) + attempt_log(
        11, 20, resume(10, 1), (15, 20), shift=0.1
    )
    for log, why in [(died, "--max-restarts"), (scratch, "from scratch"), (no_load, "from scratch"), (rare, "--save-interval <= 5"),
                     (drift, "same trajectory")]:  # fmt: skip
        with pytest.raises(ExerciseError, match=why):
            restarts.check_survived(log, REFERENCE, max_interval=5)


def test_young_daly_interval_minimises_the_lost_time():
    save_s, mtbf_s = 60.0, 3 * 3600.0
    best = faults.young_daly_interval(save_s, mtbf_s)
    assert best == pytest.approx(1138.4, abs=0.1)  # sqrt(2 x 60 x 10800)
    assert faults.daly_interval(save_s, mtbf_s) == pytest.approx(best - save_s)
    lost = [faults.lost_fraction(t, save_s, mtbf_s) for t in (0.5 * best, best, 2 * best)]
    assert lost[1] < lost[0] and lost[1] < lost[2]
    assert faults.job_mtbf_s(16384 * 3 * 3600.0, 16384) == 3 * 3600.0
    assert faults.last_iteration(SURVIVED) == 20 and faults.last_iteration("") == 0


def test_a_rank_is_the_process_that_runs_the_script_not_its_launcher():
    py, script = "/venv/bin/python3", "/lab/code/pretrain_gpt.py"
    assert fault_agent.runs_script([py, "-u", script, "--num-layers", "2"])  # torchrun's worker, srun's task
    assert not fault_agent.runs_script([py, "/venv/bin/torchrun", "--nnodes=2", script])  # the agent names it
    assert not fault_agent.runs_script([py, "-m", "torch.distributed.run", script])
    assert not fault_agent.runs_script([py, "-c", "import x", script]) and not fault_agent.runs_script([py])


def test_kill_node_kills_every_process_of_the_job_but_its_own_step(tmp_path, monkeypatch, capsys):
    """A node lost: the launcher and its rank (step 0) die; the step that kills (step 1) lives."""
    worker = tmp_path / "pretrain_gpt.py"
    worker.write_text("import time; time.sleep(60)")
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    agent = subprocess.Popen(sleep)
    rank = subprocess.Popen([sys.executable, str(worker)], env={**os.environ, "RANK": "3"})
    own = subprocess.Popen(sleep)
    try:
        rows = [(agent.pid, "0"), (rank.pid, "0"), (own.pid, "1")]
        monkeypatch.setattr(fault_agent, "job_pids", lambda job: rows)
        monkeypatch.setenv("SLURM_STEP_ID", "1")
        time.sleep(0.5)  # the rank's environment is readable once it runs
        assert fault_agent.main(["kill-node", "--job", "7"]) == 0
        assert agent.wait(timeout=10) == rank.wait(timeout=10) == -signal.SIGKILL
        assert own.poll() is None
        line = capsys.readouterr().out
        assert (
            f"kill -KILL {agent.pid} ({Path(sys.executable).name})" in line and f"{rank.pid} (rank 3)" in line
        ), line
    finally:
        for proc in (agent, rank, own):
            proc.kill()
            proc.wait()


THROTTLED_COUNT = "import time\nn, t = 0, time.time()\nwhile time.time() - t < 4: n += 1\nprint(n)"


def test_a_throttled_process_gets_its_share_on_a_busy_machine():
    """``fault_agent throttle --share 0.8`` beside 4 busy processes (2 cores oversubscribed, as a
    loaded classroom machine): a counting process makes about 0.2 of the progress of its unthrottled
    twin in the same 4 s (0.19 to 0.28 measured). Plain 20 ms sleeps gave 0.48 to 0.88 there."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(4)]
    try:
        target, twin = (
            subprocess.Popen([sys.executable, "-c", THROTTLED_COUNT], stdout=subprocess.PIPE, text=True)
            for _ in range(2)
        )
        throttle = threading.Thread(target=fault_agent.stop_for_share, args=(target.pid, 0.8, 0.2))
        throttle.start()
        ratio = int(target.communicate(timeout=60)[0]) / int(twin.communicate(timeout=60)[0])
        throttle.join(timeout=10)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert ratio < 0.4, f"the throttled process made {ratio:.2f} of its twin's progress (0.2 expected)"


def test_the_nodes_side_of_faults_starts_without_torch() -> None:
    """``python -m distlab.fault_agent`` runs on the nodes between two iterations of the run it signals:
    importing torch there (2 s or more on a loaded node) lets a short run end before its kill."""
    code = "import sys, distlab.fault_agent; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out


# --- the torchrun lines of every notebook -----------------------------------------------------------
NOTEBOOKS_9_10 = [
    REPO_ROOT / "notebooks" / "09_context_and_expert_parallelism.ipynb",
    REPO_ROOT / "solutions" / "09_context_and_expert_parallelism_solution.ipynb",
    REPO_ROOT / "notebooks" / "10_fault_tolerance.ipynb",
    REPO_ROOT / "solutions" / "10_fault_tolerance_solution.ipynb",
]


def _batch_scripts(path: Path) -> list[str]:
    """The %%writefile cells of a notebook, continuation lines joined."""
    import json

    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    return [c.replace("\\\n", " ") for c in cells if c.startswith("%%writefile")]


def test_multi_node_torchrun_lines_name_their_rendezvous():
    """PyTorch's documentation asks multi-node runs for a --rdzv-id shared by the nodes and unique to
    the job: every line of every notebook's batch scripts with a c10d endpoint sets the job's id, and
    so do the launch lines in the entry scripts' docstrings."""
    books = sorted((REPO_ROOT / "notebooks").glob("*.ipynb")) + sorted(
        (REPO_ROOT / "solutions").glob("*.ipynb")
    )
    lines = [
        (p.name, line)
        for p in books
        for s in _batch_scripts(p)
        for line in s.splitlines()
        if "--rdzv-endpoint=" in line and not line.lstrip().startswith("#")
    ]
    lines += [
        (p.name, line)
        for p in sorted((REPO_ROOT / "code").glob("*.py"))
        for line in p.read_text().replace("\\\n", " ").splitlines()
        if "--rdzv-endpoint=" in line
    ]
    assert len(lines) >= 30
    assert {name for name, _ in lines} >= {p.name for p in NOTEBOOKS_9_10}
    missing = [(name, line.strip()) for name, line in lines if "--rdzv-id=$SLURM_JOB_ID" not in line]
    assert not missing, missing


def test_the_grace_that_signal_buys_reaches_the_workers(monkeypatch):
    """torchrun SIGKILLs its workers ``--shutdown-timeout`` seconds after passing a signal on (30 by
    default in the installed torch, as notebook 10 says): a script that traps ``--signal=B:USR1@N``
    must raise it above 30 and keep it within N."""
    import re

    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import config_from_args, get_args_parser

    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == 30
    config = config_from_args(get_args_parser().parse_args(["--shutdown-timeout=100", "train.py"]))[0]
    assert config.shutdown_timeout == 100
    graced = [s for p in NOTEBOOKS_9_10 for s in _batch_scripts(p) if "--signal=B:USR1@" in s]
    assert graced
    for script in graced:
        grace = int(re.search(r"--signal=B:USR1@(\d+)", script).group(1))
        shutdown = re.search(r"--shutdown-timeout=(\d+)", script)
        assert shutdown and 30 < int(shutdown.group(1)) <= grace, script


def test_save_costs_tell_a_save_that_ran_beside_training_from_one_that_blocked():
    """Notebook 10's check of its asynchronous saves (medians measured by the notebook's job): the
    write ran beside training when the median blocking time is at most ASYNC_BLOCKING_SHARE of
    the median total; a save that blocked for its whole write fails it."""

    def log(plain: list[float], asynchronous: list[tuple[float, float]]) -> str:
        lines = [
            SAVED.format(iteration=1, folder="/c", format="torch", blocking_ms=ms, total_ms=ms)
            for ms in plain
        ]
        lines += [SAVED.format(iteration=i, folder="/c-async", format="torch_dist", mode="async", blocking_ms=b,
                               total_ms=t) for i, (b, t) in enumerate(asynchronous, start=1)]  # fmt: skip
        return "\n".join(lines) + "\n"

    measured = [(887.2, 1296.5), (231.3, 1305.0), (439.0, 1008.4), (411.8, 1017.8)]  # a CI run (load ~14)
    costs = restarts.save_costs(log([543.4], measured))
    assert costs["plain"] == 543.4 and costs["async_saves"] == 4 and costs["overlapped"]
    assert costs["async_blocking"] == pytest.approx(425.4) and costs["async_total"] == pytest.approx(1157.15)
    blocked = [(t - 1.0, t) for _, t in measured]  # the write done before the save returned
    assert not restarts.save_costs(log([543.4], blocked))["overlapped"]
    assert restarts.save_costs(log([543.4], []))["async_saves"] == 0
    synchronous = SAVED.format(
        iteration=1, folder="/c", format="torch_dist", blocking_ms=500.0, total_ms=500.0
    )
    assert restarts.save_costs(synchronous + "\n")["plain"] == 500.0  # plain: either format's


def test_a_peer_that_timed_out_first_makes_this_rank_a_survivor_of_the_hang() -> None:
    """gloo's two texts of a hang: this rank's own timeout, or a peer's a moment earlier (it closes
    its connections: seen in CI, where rank 3 then crashed before the report and took it with it).
    A peer that crashed closes them long before the timeout: no hang."""
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.11]:52109")
    assert is_hang(RuntimeError("Timed out waiting 6000ms for recv operation to complete"), 6.0, 6.0)
    assert is_hang(closed, waited_s=5.9, timeout_s=6.0)
    assert not is_hang(closed, waited_s=0.2, timeout_s=6.0)  # a crash, not a hang
    assert not is_hang(RuntimeError("CUDA error: an illegal memory access"), 60.0, 6.0)
    assert not is_hang(ValueError("Timed out waiting"), 6.0, 6.0)
