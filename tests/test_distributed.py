"""Rank discovery for every launcher (distlab.distributed), real process groups started from it, and
each rank's own settings (distlab.rank_process).

Each launcher names rank/world/local rank differently; ``discover`` must read each correctly and
prefer torchrun's variables (srun + torchrun sets both SLURM_* and RANK/WORLD_SIZE).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distlab import distributed as D
from distlab import rank_process
from distlab.local_ranks import free_port

pytestmark = pytest.mark.timeout(90)

SLURM_2x2 = {  # what srun exports to task 3 of `srun --nodes=2 --ntasks-per-node=2` in job 4242
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_NNODES": "2",
}


def test_torchrun_variables():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "29400",
    }
    assert D.discover(env) == D.DistEnv(5, 8, 1, 4, "gpu07", 29400, "torchrun")
    assert D.discover(env).node_rank == 1


def test_torchrun_inside_srun_wins_over_slurm():
    """srun + torchrun: one Slurm task per node, torchrun's RANK is the rank that counts."""
    env = {
        **SLURM_2x2,
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "24242",
    }
    got = D.discover(env)
    assert (got.launcher, got.rank, got.world_size, got.local_rank, got.node_rank) == ("torchrun", 2, 4, 0, 1)


def test_open_mpi_variables():
    """Under Slurm, mpirun's ranks also inherit SLURM_* from the srun that started Open MPI's
    daemons (one per node): OMPI_COMM_WORLD_* must win."""
    env = {
        **SLURM_2x2,
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert D.discover(env) == D.DistEnv(3, 4, 1, 2, "node1", 20000 + 4242, "mpirun")


def test_mpirun_under_pbs_finds_the_first_node_and_port_from_pbs(tmp_path):
    """PBS exports no Slurm variables: the rendezvous host is the first line of $PBS_NODEFILE
    (one line per slot) and the port comes from the number in PBS_JOBID."""
    nodefile = tmp_path / "nodes"
    nodefile.write_text("gpu32\ngpu32\ngpu33\ngpu33\n")
    env = {
        "PBS_NODEFILE": str(nodefile),
        "PBS_JOBID": "81234.pbs-server",
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert D.discover(env) == D.DistEnv(2, 4, 0, 2, "gpu32", 20000 + 81234 % 20000, "mpirun")


MPI_2x1 = {  # what mpirun gives rank 1 of `mpirun -np 2 --hostfile hosts` (one slot per node)
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
}


def test_mpirun_over_ssh_takes_the_rendezvous_from_its_x_flags():
    """Outside Slurm and PBS, a remote rank knows MASTER_ADDR/PORT only from ``mpirun -x``."""
    env = {**MPI_2x1, "MASTER_ADDR": "gpu32", "MASTER_PORT": "29411"}
    assert D.discover(env) == D.DistEnv(1, 2, 0, 1, "gpu32", 29411, "mpirun")
    for missing in ("MASTER_ADDR", "MASTER_PORT"):
        half = {k: v for k, v in env.items() if k != missing}
        with pytest.raises(
            ValueError, match=f"no {missing}: .* add -x MASTER_ADDR=<first host> -x MASTER_PORT"
        ):
            D.discover(half)
    one_node = {**MPI_2x1, "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert D.discover(one_node).master_addr == "127.0.0.1"  # every rank on this host: localhost is right
    assert D.discover({**MPI_2x1, **SLURM_2x2}).master_addr == "node1"  # inside a job: its first node


def test_half_set_launcher_variables_are_refused():
    with pytest.raises(ValueError, match="torchrun's variables are half set: RANK=3 without WORLD_SIZE"):
        D.discover({"RANK": "3", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"})
    with pytest.raises(ValueError, match="mpirun's variables are half set: .* without OMPI_COMM_WORLD_SIZE"):
        D.discover({k: v for k, v in MPI_2x1.items() if k != "OMPI_COMM_WORLD_SIZE"})
    with pytest.raises(ValueError, match="MASTER_PORT='node1:29500' is not a port number"):
        D.discover({**MPI_2x1, "MASTER_ADDR": "node1", "MASTER_PORT": "node1:29500"})


def test_network_settings_line():
    assert rank_process.network_settings({"PATH": "/bin", "TORCH_NCCL_TRACE_BUFFER_SIZE": "1"}) is None
    env = {"NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"}
    assert (
        rank_process.network_settings(env)
        == "GLOO_SOCKET_IFNAME=eth0 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=^docker,lo"
    )


def test_srun_variables():
    got = D.discover(SLURM_2x2)
    assert got == D.DistEnv(3, 4, 1, 2, "node1", 24242, "srun")
    assert got.node_rank == 1
    assert D.discover({**SLURM_2x2, "SLURM_STEP_TASKS_PER_NODE": "3,1"}).local_world_size == 3


def test_batch_script_alone_is_a_single_process():
    """Inside sbatch but outside srun there is a SLURM_JOB_ID yet no step: one process."""
    got = D.discover({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1", "SLURM_PROCID": "0"})
    assert (got.launcher, got.rank, got.world_size, got.master_addr) == ("single", 0, 1, "node1")
    assert D.discover({}) == D.DistEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")


def test_expand_hostlist():
    assert D.expand_hostlist("node[1-2]") == ["node1", "node2"]
    assert D.expand_hostlist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert D.expand_hostlist("127.0.0.11") == ["127.0.0.11"]


def test_backend_choice_and_errors():
    assert D.pick_backend(None) == ("nccl" if torch.cuda.is_available() else "gloo")
    assert D.pick_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="unknown distributed backend 'ncl'"):
        D.pick_backend("ncl")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            D.pick_backend("nccl")
    assert D.pick_device("gloo", 3) == torch.device("cpu")


def test_cpu_threads_are_capped(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    before = torch.get_num_threads()
    try:
        note = rank_process.cap_cpu_threads(local_world_size=10_000)
        assert torch.get_num_threads() == 1 and "capped" in note
    finally:
        torch.set_num_threads(before)


def test_ranks_of_nodes_on_one_machine_share_its_cores():
    """The local cluster's nodes are one machine (its site profile says so): one rank on each of
    two nodes is two ranks on these cores; elsewhere only the node's own ranks count."""
    local = {"LAB_NODES_SHARE_CORES": "1", "SLURM_JOB_NUM_NODES": "2"}
    assert rank_process.ranks_sharing_cores(1, local) == 2
    assert rank_process.ranks_sharing_cores(2, local) == 4
    assert rank_process.ranks_sharing_cores(1, {"SLURM_JOB_NUM_NODES": "2"}) == 1
    assert rank_process.ranks_sharing_cores(2, {"LAB_NODES_SHARE_CORES": "1"}) == 2  # not a Slurm job


def _srun_task(task: int, port: int, out: str) -> None:
    os.environ.update(
        {
            **SLURM_2x2,
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task % 2),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK"):
        os.environ.pop(key, None)
    ctx = D.init_distributed(backend="gloo", timeout_s=60)
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    with open(f"{out}.{task}.json", "w") as f:
        json.dump([ctx.env.launcher, ctx.rank, ctx.world_size, ctx.env.local_rank, t.item()], f)
    D.shutdown()


def test_srun_alone_starts_a_process_group(tmp_path):
    """Four 'srun tasks' (only SLURM_* variables) form one group: all-reduce of ranks = 0+1+2+3."""
    mp.start_processes(_srun_task, args=(free_port(), str(tmp_path / "t")), nprocs=4, start_method="spawn")
    got = [json.loads((tmp_path / f"t.{i}.json").read_text()) for i in range(4)]
    assert got == [["srun", i, 4, i % 2, 6.0] for i in range(4)]


PROBE = """
import json, torch, torch.distributed as dist
from distlab.distributed import init_distributed, shutdown
ctx = init_distributed(backend="gloo", timeout_s=60)
t = torch.tensor([float(ctx.rank)]); dist.all_reduce(t)
print(json.dumps([ctx.env.launcher, ctx.rank, ctx.world_size, ctx.env.local_rank, t.item()]), flush=True)
shutdown()
"""


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_mpirun_starts_a_process_group():
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []  # Open MPI refuses root without it
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))
    }
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run(
        [
            "mpirun",
            "-np",
            "2",
            *root,
            "--oversubscribe",
            "-x",
            "MASTER_ADDR",
            "-x",
            "MASTER_PORT",
            sys.executable,
            "-c",
            PROBE,
        ],
        capture_output=True,
        text=True,
        timeout=80,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = sorted(json.loads(line) for line in out.stdout.splitlines() if line.startswith("["))
    assert got == [["mpirun", 0, 2, 0, 1.0], ["mpirun", 1, 2, 1, 1.0]]


def test_stdout_writes_whole_lines(monkeypatch):
    """Ranks share a log: after ``whole_line_stdout`` each line is one write, even unbuffered."""
    import io

    class Recorder(io.RawIOBase):
        def __init__(self):
            self.writes: list[bytes] = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)

    raw = Recorder()
    unbuffered = io.TextIOWrapper(raw, write_through=True)  # what python -u makes of stdout
    monkeypatch.setattr(sys, "stdout", unbuffered)
    print("before", flush=True)
    assert raw.writes == [b"before", b"\n"]  # the problem: text and newline apart
    raw.writes.clear()
    rank_process.whole_line_stdout()
    print("iteration 1 | lm loss: 7.0 |", flush=True)
    print("a", "b")
    assert raw.writes == [b"iteration 1 | lm loss: 7.0 |\n", b"a b\n"]
