"""pretrain_gpt.py --deepspeed started by DeepSpeed's own ``deepspeed`` launcher on the local cluster.

The batch script builds DeepSpeed's hostfile (``<host> slots=<processes>``, one line per node) from
Slurm's node list and runs ``deepspeed --launcher slurm``: the runner starts the ranks with
``srun -n <total slots>`` inside the allocation, so no ssh between nodes is needed
(``--no_ssh_check`` skips the ssh test of its default launcher, pdsh). One rank on each of the
two nodes, ZeRO-1, gloo. This is notebook 07's script with tiny sizes.

Skipped with a reason when no cluster answers (see the ``slurm_cluster`` fixture in conftest.py).
"""

from __future__ import annotations

import json
import re

import pytest

from distlab import jobs
from distlab.gpt.local_run import prepare_data
from distlab.gpt.log import ITERATION_RE

pytestmark = pytest.mark.timeout(420)

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
deepspeed --hostfile $HOSTFILE --launcher slurm --no_ssh_check --master_addr $MASTER_ADDR \\
    --master_port $MASTER_PORT $LAB_CODE/pretrain_gpt.py \\
    --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 \\
    --micro-batch-size 2 --global-batch-size 4 --train-iters 4 --lr 1e-3 --split 98,1,1 \\
    --log-interval 1 --eval-iters 0 --distributed-backend $LAB_BACKEND \\
    --deepspeed --deepspeed_config {out}/ds_config.json --zero-stage 1 {data}
"""


def test_deepspeed_launcher_from_slurm_hostfile(slurm_cluster, tmp_path):
    data = prepare_data(tmp_path / "data", vocab_size=512, max_files=80)
    (tmp_path / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    script = tmp_path / "gpt-ds-launcher.sbatch"
    script.write_text(SBATCH.format(out=tmp_path, data=" ".join(data.argv())))
    job = jobs.run(script, timeout=360)
    text = job.log()
    hosts = re.findall(r"^(\S+) slots=1$", text, re.M)
    assert len(hosts) == 2 and hosts[0] != hosts[1], text[-3000:]
    assert job.grep(r"cmd = srun -n 2 "), text[-3000:]  # the runner's own srun line
    assert "using world size: 2, data-parallel-size: 2" in text, text[-3000:]
    # --zero-stage overrides the JSON's stage; the batch rule as DeepSpeed sees it
    assert "> deepspeed: ZeRO stage 1 | train_batch_size 4 = micro 2 x accumulation 1 x world size" in text
    for rank in (0, 1):  # each rank's own memory line, gathered from both processes
        assert f"[rank {rank} tp 0 pp 0 dp {rank}] memory (MiB): parameters" in text, text[-3000:]
    its = [m for m in map(ITERATION_RE.match, text.splitlines()) if m]
    assert [int(m["it"]) for m in its] == [1, 2, 3, 4], text[-3000:]
    losses = [float(m["loss"]) for m in its]
    assert all(0 < x < 10 for x in losses), losses  # ln(512) = 6.2 at the start
