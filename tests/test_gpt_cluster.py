"""pretrain_gpt.py on the local Slurm cluster: srun + torchrun, 2 nodes x 2 processes, Megatron lines.

Skipped with a reason when no cluster answers (see the ``slurm_cluster`` fixture in conftest.py).
"""

from __future__ import annotations

import pytest

from distlab import jobs
from distlab.gpt.training.log import ITERATION_RE
from distlab.local_runs import prepare_data

pytestmark = pytest.mark.timeout(300)

SBATCH = """#!/bin/bash
#SBATCH --job-name=gpt-2x2
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}/%x-%j.out
source "$LAB_ROOT/sites/job-env.sh"
export OMP_NUM_THREADS=64   # what cluster scripts often do; pretrain_gpt.py caps it to the real cores
srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=$LAB_PROCS_PER_NODE \\
     --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT $LAB_CODE/pretrain_gpt.py \\
     --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 \\
     --micro-batch-size 1 --global-batch-size 8 --train-iters 4 --lr 1e-3 --lr-decay-style cosine \\
     --split 90,10,0 --log-interval 2 --eval-interval 4 --eval-iters 1 \\
     --distributed-backend $LAB_BACKEND --save {out}/ckpt --save-interval 2 {data}
"""


def test_two_nodes_two_processes_each(slurm_cluster, tmp_path):
    data = prepare_data(tmp_path / "data", vocab_size=512, max_files=80)
    script = tmp_path / "gpt.sbatch"
    script.write_text(SBATCH.format(out=tmp_path, data=" ".join(data.argv())))
    job = jobs.run(script, timeout=240)
    text = job.log()
    assert (
        "using world size: 4, data-parallel-size: 4, tensor-model-parallel size: 1, pipeline-model-parallel "
        "size: 1" in text
    )
    assert "micro batch 1 x data-parallel 4 x accumulation steps 2" in text
    assert "(OMP_NUM_THREADS=64 capped)" in text
    its = [int(m["it"]) for m in map(ITERATION_RE.match, text.splitlines()) if m]
    assert its == [2, 4]
    assert job.grep(r"validation loss at iteration 4 \| lm loss value: ")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"
    # torch_dist, the default: a file per rank
    saved = sorted(p.name for p in (tmp_path / "ckpt" / "iter_0000004").iterdir())
    assert saved == [".metadata", *(f"__{rank}_0.distcp" for rank in range(4)), "common.pt"]
