"""pretrain_gpt.py --deepspeed on two nodes of the local cluster, started two ways in one job.

1. DeepSpeed's own ``deepspeed`` launcher. The batch script builds its hostfile
   (``<host> slots=<processes>``, one line per node) from Slurm's node list and runs
   ``deepspeed --launcher slurm``: the runner starts the ranks with ``srun -n <total slots>`` inside
   the allocation (ranks from ``SLURM_PROCID``), so no ssh between nodes is needed
   (``--no_ssh_check`` skips the ssh test of its default launcher, pdsh). The runner also reads a
   ``.deepspeed_env`` file (here named by ``DS_ENV_FILE``) and exports its ``VAR=value`` lines to
   every rank: each rank prints the ``NCCL_*``/``GLOO_*`` settings it sees, which the batch shell
   itself does not have.
2. ``mpirun`` with the same hostfile (ranks from ``OMPI_COMM_WORLD_*``, the rendezvous from
   ``-x MASTER_ADDR -x MASTER_PORT``), as clusters without Slurm start DeepSpeed; inside the
   allocation Open MPI starts its daemons through Slurm. The losses equal the first run's.

One rank on each of the two nodes, ZeRO-1, gloo; notebook 07's script with tiny sizes. Skipped
with a reason when no cluster answers (see the ``slurm_cluster`` fixture in conftest.py).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from distlab import jobs
from distlab.local_runs import prepare_data
from distlab.logs import megatron

pytestmark = pytest.mark.timeout(420)

#: What the env file exports; the batch shell has none of these (the test checks it).
DS_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}

SBATCH = """#!/bin/bash
#SBATCH --job-name=gpt-ds-launcher
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --output={out}/%x-%j.out
source "$LAB_ROOT/sites/job-env.sh"
HOSTFILE={out}/hostfile-$SLURM_JOB_ID
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/ slots=$SLURM_NTASKS_PER_NODE/" > $HOSTFILE
cat $HOSTFILE
echo "batch shell: $(env | grep -c '^NCCL_\\|^GLOO_') NCCL/GLOO variables"
ARGS="--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 \\
    --micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3 --split 98,1,1 \\
    --log-interval 1 --eval-iters 0 --distributed-backend $LAB_BACKEND \\
    --deepspeed --deepspeed_config {out}/ds_config.json --zero-stage 1 {data}"
DS_ENV_FILE={out}/deepspeed_env deepspeed --hostfile $HOSTFILE --launcher slurm --no_ssh_check \\
    --master_addr $MASTER_ADDR --master_port $MASTER_PORT $LAB_CODE/pretrain_gpt.py $ARGS || exit 1
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun -np $SLURM_NTASKS --hostfile $HOSTFILE -x MASTER_ADDR -x MASTER_PORT -x PATH \\
    python $LAB_CODE/pretrain_gpt.py $ARGS
"""


def test_deepspeed_launcher_with_env_file_then_mpirun(slurm_cluster, tmp_path):
    data = prepare_data(tmp_path / "data", vocab_size=512, max_files=80)
    (tmp_path / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    (tmp_path / "deepspeed_env").write_text("".join(f"{k}={v}\n" for k, v in DS_ENV.items()))
    script = tmp_path / "gpt-ds-launcher.sbatch"
    script.write_text(SBATCH.format(out=tmp_path, data=" ".join(data.argv())))
    job = jobs.run(script, timeout=360)
    text = job.log()
    hosts = re.findall(r"^(\S+) slots=1$", text, re.M)
    assert len(hosts) == 2 and hosts[0] != hosts[1], text[-3000:]
    assert "batch shell: 0 NCCL/GLOO variables" in text, text[:2000]
    launcher, mpi = megatron.split_runs(text)
    # the runner read the file and put its lines on its own srun line, for every rank
    assert f"deepspeed_env file = {tmp_path}/deepspeed_env" in text, text[-3000:]
    srun = job.grep(r"cmd = srun -n 2 ")
    assert len(srun) == 1 and all(f"{k}={v}" in srun[0] for k, v in DS_ENV.items()), srun
    settings = " ".join(f"{k}={v}" for k, v in sorted(DS_ENV.items()))
    seen = re.findall(rf"^> rank (\d) on (\S+): {re.escape(settings)}$", text, re.M)
    assert sorted(seen) == [("0", hosts[0]), ("1", hosts[1])], text[-3000:]
    assert "> rank" not in mpi  # mpirun was given no env file: the variables came from it alone
    # --zero-stage overrides the JSON's stage; the batch rule as DeepSpeed sees it
    for run, name in ((launcher, "srun"), (mpi, "mpirun")):
        assert "using world size: 2, data-parallel-size: 2" in run, run[-3000:]
        assert f"> launcher: {name}, backend: gloo" in run, run[:3000]
        assert "> deepspeed: ZeRO stage 1 | train_batch_size 4 = micro 2 x accumulation 1 x world size" in run
        for rank in (0, 1):  # each rank's own memory line, gathered from both processes
            assert f"[rank {rank} tp 0 pp 0 dp {rank}] memory (MiB): parameters" in run, run[-3000:]
    losses = [[r["loss"] for r in megatron.iterations(run)] for run in (launcher, mpi)]
    assert [len(x) for x in losses] == [3, 3] and all(0 < x < 10 for x in losses[0]), losses  # ln 512 = 6.2
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)  # the same ranks, started by MPI
