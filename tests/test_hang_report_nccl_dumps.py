"""diagnose_hang.py on folders of NCCL-format dumps, every rank missing in turn (rank 0 and the last).

Four gloo ranks (tensor-parallel groups [0, 1] and [2, 3]) play four rounds; in round k rank k
skips an all-reduce of the default group. The others start it (``async_op``: it stays unfinished,
as a collective NCCL's watchdog finds past its timeout) and write their flight records with
torch's own serializer (``_dump_fr_trace``: the template that also writes NCCL's
``_dump_nccl_trace``, same version and keys); only two things are made as NCCL records them:
``pg_config`` (gloo's recorder in torch 2.14 lists one unnamed group) and the ``nccl:`` prefix of
the operations. Two folders per round: ``frozen_k`` (rank k wrote no dump: SIGSTOP, a dead node)
and ``skipped_k`` (rank k dumped while in no collective, as every live rank does on NCCL). Then
rank k joins and the next round starts. Every folder holds the start records
(``started_<rank>.json``), one copy of ``frozen_k`` none.

The checks: PyTorch's analyzer (``torchfrtrace``) accepts each folder and finds rank k missing;
``diagnose_hang.py`` takes the world from the groups' records, says ``no dump from ranks {k}``
and names rank k, the collective, its group, sequence number and node (``?`` without records).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab import REPO_ROOT, flight_recorder, rank_identity
from distlab.local_ranks import free_port, spawn_ranks, torchrun_env
from distlab.logs import hangs

pytestmark = pytest.mark.timeout(180)
WORLD = 4
FIRST_SEQ = 3  # the default group's first all-reduce: start()'s all_gather_object made two


def nccl_record(unfinished: int) -> bytes:
    """This rank's record by torch's serializer, with pg_config and op names as NCCL writes them,
    once only ``unfinished`` entries are not retired (gloo retires a finished collective a moment
    after it returns; NCCL's watchdog has long retired them when it dumps)."""
    deadline = time.monotonic() + 30
    while True:
        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
        if sum(not e["retired"] for e in trace["entries"]) <= unfinished or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    trace["pg_config"] = flight_recorder.pg_config()
    for entry in trace["entries"]:
        entry["profiling_name"] = entry["profiling_name"].replace("gloo:", "nccl:")
    return pickle.dumps(trace)


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_bytes(data)
    partial.replace(path)


def rounds(rank: int, port: int, base: str) -> None:
    os.environ.update(torchrun_env(rank, WORLD, port), TORCH_FR_BUFFER_SIZE="200")
    dist.init_process_group("gloo")
    tp = [dist.new_group(r, group_desc="tp") for r in ([0, 1], [2, 3])]
    flight_recorder.start(str(Path(base, "records", "rank_")))
    rank_identity.record(Path(base, "records"), rank_identity.identity(rank))  # start() on NCCL writes it
    x = torch.ones(2, 4)
    for k in range(WORLD):
        frozen, skipped = Path(base, f"frozen_{k}"), Path(base, f"skipped_{k}")
        dist.all_reduce(x, group=tp[rank // 2])
        if rank == k:
            write(skipped / f"rank_{rank}", nccl_record(0))  # alive, in no collective
            others = [frozen / f"rank_{r}" for r in range(WORLD) if r != k]
            while not all(p.exists() for p in others):
                time.sleep(0.05)
            dist.all_reduce(x)  # late: the others' all-reduce finishes now
        else:
            work = dist.all_reduce(x, async_op=True)  # waits for rank k
            record = nccl_record(1)
            write(skipped / f"rank_{rank}", record)
            write(frozen / f"rank_{rank}", record)
            work.wait()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("nccl_dumps")
    spawn_ranks(rounds, (free_port(), str(base)), nprocs=WORLD)
    for k in range(WORLD):
        shutil.copytree(base / f"frozen_{k}", base / f"unrecorded_{k}")
        for kind in ("frozen", "skipped"):
            for record in (base / "records").glob("started_*.json"):
                shutil.copy(record, base / f"{kind}_{k}")
    return base


def test_pytorchs_analyzer_reads_the_folders_and_finds_the_missing_rank(folders):
    names = [f"{kind}_{k}" for k in range(WORLD) for kind in ("frozen", "skipped")]
    script = (
        "import sys\nfrom torch.distributed.flight_recorder.fr_trace import main\n"
        "for folder in sys.argv[1:]:\n    print('=== ' + folder, flush=True)\n"
        "    try:\n        main([folder])\n    except BaseException as exc:\n        print(repr(exc), flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, *(str(folders / n) for n in names)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    )  # fmt: skip
    text = out.stdout
    parts = dict(re.findall(r"=== \S+/(\w+)\n(.*?)(?==== |\Z)", text, flags=re.S))
    assert sorted(parts) == sorted(names), text[-3000:]
    for k in range(WORLD):
        assert f"Missing dump files from ranks {{{k}}}" in parts[f"frozen_{k}"], parts[f"frozen_{k}"][-2000:]
        skipped = parts[f"skipped_{k}"]
        assert f"sequence number: {FIRST_SEQ + k}" in skipped and f"missing ranks: {{{k}}}" in skipped, (
            skipped
        )


def diagnose(folder: Path, capsys) -> str:
    sys.path.insert(0, str(REPO_ROOT / "code"))
    import diagnose_hang

    capsys.readouterr()
    assert diagnose_hang.main([str(folder)]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("k", range(WORLD))
def test_every_rank_without_a_dump_is_named_with_its_collective_and_node(folders, capsys, k):
    missed = f"nccl:all_reduce #{FIRST_SEQ + k} of group 0 (default_pg) [0, 1, 2, 3], sizes [[2, 4]]"
    report = diagnose(folders / f"frozen_{k}", capsys)
    assert f"no dump from ranks {{{k}}}: " in report, report
    assert hangs.ranks_without_dump(report) == [k]  # notebook 12's check reads it so
    assert "3 of 4 ranks wrote a flight record" in report, report
    assert f"> hang: ranks [{k}] did not join {missed}: rank {k} on {socket.gethostname()} (pid " in report
    assert (
        f"> hang: rank {k} on {socket.gethostname()} (pid " in report and "wrote no flight record" in report
    )
    unrecorded = diagnose(folders / f"unrecorded_{k}", capsys)
    assert f"> hang: ranks [{k}] did not join {missed}: rank {k} on ?\n" in unrecorded, unrecorded


@pytest.mark.parametrize("k", range(WORLD))
def test_a_live_rank_that_skipped_the_collective_is_named(folders, capsys, k):
    report = diagnose(folders / f"skipped_{k}", capsys)
    assert "no dump from ranks" not in report and "4 of 4 ranks wrote a flight record" in report, report
    assert hangs.ranks_without_dump(report) == []
    assert (
        f"> hang: ranks [{k}] did not join nccl:all_reduce #{FIRST_SEQ + k} of group 0 (default_pg)" in report
    )
