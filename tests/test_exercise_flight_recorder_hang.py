"""Notebook 12's write-it-yourself exercise (``distlab.exercises.flight_recorder_hang``) on real dumps.

Four gloo ranks laid out as the notebook's TP 2 x PP 2 (tensor-parallel groups [0, 1] and [2, 3],
pipeline groups [0, 2] and [1, 3]) run a few collectives; then rank 3 stops taking part. Rank 2
waits for it in a tensor-parallel all-reduce, rank 1 in a pipeline receive from it (gloo lists no
point-to-point operation: the dump carries it as the engine's does), and rank 0 in an all-reduce
with rank 1, which never comes: a cascade, rank 1's record stopping short of rank 0's collective
although rank 1 is not the cause. Each waiting rank times out (3 s) and dumps its record with
``distlab.flight_recorder.dump``, the engine's own writer, as in the notebook's job:

* ``frozen``: rank 3 writes nothing (frozen, as the notebook's SIGSTOP);
* ``all_dumped``: rank 3, alive but busy elsewhere, dumps too while in no collective (on GPUs NCCL's
  watchdog makes every rank dump).

The checks: the course's reading (``expected``) agrees with ``hang_report`` and, where every rank
dumped, with PyTorch's ``torchfrtrace`` (which names the cascade's rank 1 as well; with a dump
missing it only names that rank: tests/test_flight_recorder.py); the notebook's stub
says "not yet"; typical wrong answers (the first rank whose dump was written, the cascade's rank,
the right rank with a collective it joined, one past the last, or a group it is not in) are told
wrong with hints that name neither the rank nor the sequence number; the solution notebook's
``find_hang`` passes on both folders, in well under a second.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab import REPO_ROOT, flight_recorder
from distlab.checks import FIXME, ExerciseError
from distlab.exercises import flight_recorder_hang
from distlab.local_ranks import free_port, spawn_ranks, torchrun_env

pytestmark = pytest.mark.timeout(180)

NOTEBOOK = REPO_ROOT / "notebooks" / "12_hangs_and_stragglers.ipynb"
SOLUTION = REPO_ROOT / "solutions" / "12_hangs_and_stragglers_solution.ipynb"
FROZEN = 3


def hung_world(rank: int, port: int, prefix: str, stuck_rank_dumps: bool) -> None:
    os.environ.update(torchrun_env(rank, 4, port), TORCH_FR_BUFFER_SIZE="200")
    timeout = datetime.timedelta(seconds=3)
    dist.init_process_group("gloo", timeout=timeout)
    tp = [dist.new_group(r, timeout=timeout, group_desc="tp") for r in ([0, 1], [2, 3])]
    pp = [dist.new_group(r, timeout=timeout, group_desc="pp") for r in ([0, 2], [1, 3])]
    hosts = flight_recorder.start(prefix)
    x = torch.ones(2, 4)
    for _ in range(3):  # three "iterations": two tensor-parallel all-reduces and a pipeline one each
        dist.all_reduce(x, group=tp[rank // 2])
        dist.all_reduce(x, group=tp[rank // 2])
        dist.all_reduce(x, group=pp[rank % 2])
    if rank == FROZEN:
        if stuck_rank_dumps:  # alive, busy outside any collective past the others' timeout
            time.sleep(5)
            flight_recorder.dump(prefix, rank, hosts, None)
        others = [Path(prefix + str(r)) for r in range(4) if r != FROZEN]
        deadline = time.monotonic() + 60  # a frozen rank's sockets stay open until the others are done
        while not all(p.exists() for p in others) and time.monotonic() < deadline:
            time.sleep(0.2)
        return
    waiting = None
    try:
        if rank == 1:
            dist.recv(x, src=FROZEN)  # the pipeline's receive from the next stage
        else:
            dist.all_reduce(x, group=tp[rank // 2])  # rank 2: waits for rank 3; rank 0: for rank 1
    except RuntimeError as exc:
        assert "Timed out" in str(exc), exc
        waiting = flight_recorder.waiting_in(exc)
        if rank == 1:  # as the engine records a pipeline transfer (distlab.gpt.pretrain.report_hang)
            waiting = dict(
                op=f"pipeline irecv from rank {FROZEN}", group="pp", members=[1, 3], sizes=[[2, 4]]
            )
    flight_recorder.dump(prefix, rank, hosts, waiting)


def dumps_of(folder: Path, stuck_rank_dumps: bool) -> Path:
    spawn_ranks(hung_world, (free_port(), str(folder / "rank_"), stuck_rank_dumps), nprocs=4)
    return folder


@pytest.fixture(scope="module")
def frozen(tmp_path_factory) -> Path:
    return dumps_of(tmp_path_factory.mktemp("frozen"), stuck_rank_dumps=False)


@pytest.fixture(scope="module")
def all_dumped(tmp_path_factory) -> Path:
    return dumps_of(tmp_path_factory.mktemp("all_dumped"), stuck_rank_dumps=True)


def cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]


def notebook_stub():
    source = next(c for c in cells(NOTEBOOK) if c.startswith("def find_hang("))
    namespace = {"FIXME": FIXME}
    exec(source, namespace)
    return namespace["find_hang"]


def solution_find_hang():
    source = next(c for c in cells(SOLUTION) if c.startswith("def find_hang("))
    namespace = {"json": json, "pickle": pickle, "Path": Path}
    exec(source.split("\njobs.wait(")[0], namespace)  # the function, not the cell's job
    return namespace["find_hang"]


def run_check_cell(find_hang, folder: Path):
    source = next(c for c in cells(NOTEBOOK) if c.startswith("flight_recorder_hang.check_hang("))
    namespace = {"flight_recorder_hang": flight_recorder_hang, "find_hang": find_hang, "FR": folder}
    exec(f"result = {source}", namespace)
    return namespace["result"]


def the_answer(folder: Path) -> tuple[int, str, int]:
    hang = flight_recorder_hang.expected(folder)
    (collective,) = hang.collectives
    return hang.culprits[0], collective.group, collective.seq


def test_the_course_and_pytorch_read_the_same_hang(frozen, all_dumped):
    for folder, missing in ((frozen, [FROZEN]), (all_dumped, [])):
        hang = flight_recorder_hang.expected(folder)
        dumps = flight_recorder.read_dumps(str(folder / "rank_"))
        assert sorted(dumps) == sorted(set(range(4)) - set(missing)) and hang.world == (0, 1, 2, 3)
        rank, group, seq = the_answer(folder)
        (tp,) = [c for c in hang.collectives]
        assert rank == FROZEN and tp.members == (2, 3) and tp.desc == "tp" and tp.op == "gloo:all_reduce"
        got, lines = flight_recorder.hang_report(dumps, 4, flight_recorder.read_hosts(str(folder / "rank_")))
        assert got == missing
        assert (
            f"> hang: ranks [{FROZEN}] did not join gloo:all_reduce #{seq} of group {group} (tp) [2, 3]"
            in "\n".join(lines)
        )
        assert not any(line.startswith("> hang: ranks [1]") for line in lines), (
            lines
        )  # not the cascade's rank
    torchfrtrace = str(Path(sys.executable).with_name("torchfrtrace"))
    out = subprocess.run([torchfrtrace, str(all_dumped)], capture_output=True, text=True)
    reports = (out.stdout + out.stderr).split("Not all ranks joining collective")
    _, group, seq = the_answer(all_dumped)
    ours = [r for r in reports if f"group info: {group}:tp" in r]
    assert ours and f"sequence number: {seq}" in ours[0] and f"missing ranks: {{{FROZEN}}}" in ours[0], (
        out.stdout
    )
    assert any("missing ranks: {1}" in r for r in reports)  # PyTorch's analyzer names the cascade too


def test_the_untouched_stub_is_not_yet(frozen, tmp_path, capsys):
    assert run_check_cell(notebook_stub(), frozen) is False
    assert "[not yet]" in capsys.readouterr().out
    assert run_check_cell(notebook_stub(), tmp_path) is False  # no dump yet: the job has not hung
    assert "no flight records" in capsys.readouterr().out


def first_dump_written(folder: Path):
    """The rank whose dump was written first, with the collective it waits in."""
    first = min(folder.glob("rank_*"), key=lambda p: p.stat().st_mtime_ns)
    waiting = pickle.loads(first.read_bytes())["distlab_waiting"] or {"group": "0"}
    return int(first.name.removeprefix("rank_")), waiting["group"], waiting.get("seq") or 1


def test_wrong_answers_get_hints_that_do_not_give_the_answer(frozen, all_dumped):
    for folder in (frozen, all_dumped):
        rank, group, seq = the_answer(folder)
        hang = flight_recorder_hang.expected(folder)
        cascade = hang.waiting[0]  # rank 0 waits for rank 1 (who waits for rank 3)
        pp_name = next(
            n for d in hang.dumps.values() for n, c in d["pg_config"].items() if c["ranks"] == "[1, 3]"
        )
        pp_seq = max(
            e["collective_seq_id"] for e in hang.dumps[1]["entries"] if e["process_group"][0] == pp_name
        )
        wrong = {
            "the first rank whose dump was written": first_dump_written(folder),
            "the cascade's rank, whose record stops short": (1, cascade.group, cascade.seq),
            "the right rank, a collective it joined": (rank, pp_name, pp_seq),
            "the right rank, the collective before": (rank, group, seq - 1),
            "the right rank, one past the last": (rank, group, seq + 1),
            "the right rank, a group it is not in": (rank, cascade.group, cascade.seq),
            "a rank of another job": (7, group, seq),
            "not a triple": (rank, group),
        }
        for why, answer in wrong.items():
            with pytest.raises(ExerciseError) as told:
                run_check_cell(lambda folder, answer=answer: answer, folder)
            hint = str(told.value).split("is not right.", 1)[1]
            assert hint.strip(), why
            assert f"#{seq}" not in hint and f"seq {seq}" not in hint, (why, hint)
            if answer[0] != rank:
                assert f"rank {rank}" not in hint and f"ranks [{rank}]" not in hint, (why, hint)


def test_the_solution_passes_quickly(frozen, all_dumped, capsys):
    find_hang = solution_find_hang()
    for folder in (frozen, all_dumped):
        start = time.perf_counter()
        assert run_check_cell(find_hang, folder) is True
        assert time.perf_counter() - start < 1.0
        rank, group, seq = the_answer(folder)
        assert find_hang(folder) == (rank, group, seq)
        assert f"[ok] {flight_recorder_hang.NAME}: 'rank {rank} never joined gloo:all_reduce #{seq}" in (
            capsys.readouterr().out
        )
    # the group as an entry spells it, (name, description), is the same answer
    assert run_check_cell(lambda folder: (rank, (group, "tp"), seq), frozen) is True


def test_a_function_that_raises_is_told_the_format(frozen):
    def broken(folder):
        return {}[0]

    with pytest.raises(ExerciseError, match="raised KeyError.*Return \\(rank, group, seq\\)"):
        run_check_cell(broken, frozen)
