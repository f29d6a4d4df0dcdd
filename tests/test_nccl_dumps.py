"""distlab.nccl_dumps arms NCCL's dumps without overriding the user; distlab.rank_identity's start
records name node, pid and, with CUDA only, the GPU (UUID and PCI bus id, as nvidia-smi)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from distlab import flight_recorder, nccl_dumps, rank_identity


def test_arm_sets_what_the_user_left_unset(tmp_path):
    env: dict[str, str] = {}
    added = nccl_dumps.arm(str(tmp_path / "fr" / "rank_"), 2000, env)
    assert (
        env
        == added
        == {
            "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "rank_"),
        }
    )
    assert (tmp_path / "fr").is_dir()  # the watchdog does not create it


def test_arm_keeps_the_users_settings(tmp_path):
    older = str(tmp_path / "mine" / "nccl_trace_rank_")
    env = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": older,
    }
    added = nccl_dumps.arm(str(tmp_path / "fr" / "rank_"), 2000, env)
    assert added == {"TORCH_FR_BUFFER_SIZE": "0"} and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert "TORCH_FR_DUMP_TEMP_FILE" not in env and flight_recorder.dump_prefix(env) == older
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "fr").exists()


def test_a_cpu_rank_records_no_gpu(tmp_path):
    me = rank_identity.identity(2, torch.device("cpu"))
    assert me["rank"] == 2 and me["pid"] == os.getpid() and "gpu_uuid" not in me
    rank_identity.record(tmp_path, me)
    assert rank_identity.read(tmp_path) == {2: me}
    assert flight_recorder.read_hosts(str(tmp_path / "rank_")) == [me]
    assert rank_identity.where(me) == f"{me['node']} (pid {me['pid']})" and rank_identity.where(None) == "?"
    gpu = {**me, "gpu_uuid": "GPU-5f0c", "pci_bus_id": "00000000:1B:00.0"}
    assert rank_identity.where(gpu).endswith(", GPU GPU-5f0c at 00000000:1B:00.0)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_rank_records_its_uuid_and_pci_bus_id():
    me = rank_identity.gpu_identity(torch.device("cuda", 0))
    assert re.fullmatch(r"GPU-[0-9a-f-]{36}", me["gpu_uuid"]), me
    assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.0", me["pci_bus_id"]), me


def _start_on_gloo(rank: int, port: int, folder: str, out: str) -> None:
    import torch.distributed as dist

    from distlab.local_ranks import torchrun_env

    os.environ.update(torchrun_env(rank, 2, port))
    dist.init_process_group("gloo")
    hosts = flight_recorder.start(os.path.join(folder, "rank_"), torch.device("cpu"))
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr([h["rank"] for h in hosts]))
    dist.destroy_process_group()


def test_a_gloo_run_that_does_not_hang_leaves_no_files(tmp_path):
    """On gloo the engine's own dump writes hosts.json at a hang: start() gathers the list and
    writes nothing, so no run leaves a folder behind (the start records are NCCL's)."""
    from distlab.local_ranks import free_port, spawn_ranks

    folder, out = tmp_path / "flight_recorder_7", tmp_path / "hosts"
    spawn_ranks(_start_on_gloo, (free_port(), str(folder), str(out)), 2)
    assert out.read_text() == "[0, 1]" and not folder.exists()
