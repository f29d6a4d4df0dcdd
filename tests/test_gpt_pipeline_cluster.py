"""The course's exercise layout on the local Slurm cluster: TP=2 x PP=2 over 2 nodes x 2 processes.

Submitted from an sbatch script with ``distlab.jobs``; skipped with a reason when no cluster
answers (the ``slurm_cluster`` fixture). The run writes its pipeline timeline, which is then
drawn with the plotting helper: the plot comes from a real two-node run.
"""

from __future__ import annotations

import pytest

from distlab import jobs
from distlab.gpt.pipeline_parallel.plot import plot_timelines
from distlab.gpt.pipeline_parallel.timeline import load_timeline
from distlab.gpt.training.log import ITERATION_RE
from distlab.local_runs import prepare_data

pytestmark = pytest.mark.timeout(300)

SBATCH = """#!/bin/bash
#SBATCH --job-name=gpt-tp2-pp2
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output={out}/%x-%j.out
source "$LAB_ROOT/sites/job-env.sh"     # site profile: Python env, LAB_BACKEND, MASTER_ADDR/PORT, LAB_CODE
# 4 ranks = TP 2 x PP 2 x DP 1: ranks 0,1 (node 1) hold stage 0, ranks 2,3 (node 2) stage 1.
srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=$LAB_PROCS_PER_NODE \\
     --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT $LAB_CODE/pretrain_gpt.py \\
     --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule {schedule} \\
     --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 \\
     --micro-batch-size 2 --global-batch-size 16 --train-iters 4 --lr 1e-3 --lr-decay-style cosine \\
     --make-vocab-size-divisible-by 128 --split 90,10,0 --log-interval 1 --eval-interval 4 --eval-iters 1 \\
     --distributed-backend $LAB_BACKEND --pipeline-timeline {out}/timeline-{schedule}.json {data}
"""


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tp2_pp2_over_two_nodes(slurm_cluster, tmp_path, schedule):
    data = prepare_data(tmp_path / "data", vocab_size=512, max_files=80)
    script = tmp_path / "gpt-tp2-pp2.sbatch"
    script.write_text(SBATCH.format(out=tmp_path, data=" ".join(data.argv()), schedule=schedule))
    job = jobs.run(script, timeout=240)
    text = job.log()
    assert (
        "using world size: 4, data-parallel-size: 1, tensor-model-parallel size: 2, "
        "pipeline-model-parallel size: 2"
    ) in text
    assert f"> pipeline schedule {schedule}: 2 stages x 8 micro-batches per step" in text
    assert len(job.grep(r"memory \(MiB\): parameters")) == 4  # one line per rank after iteration 1
    its = [int(m["it"]) for m in map(ITERATION_RE.match, text.splitlines()) if m]
    assert its == [1, 2, 3, 4]  # printed by the last rank, from the last stage's loss
    assert job.grep(r"validation loss at iteration 4 \| lm loss value: ")

    timeline = load_timeline(tmp_path / f"timeline-{schedule}.json")
    assert (timeline["stages"], timeline["microbatches"], timeline["iteration"]) == (2, 8, 4)
    assert sorted((e["stage"], e["kind"]) for e in timeline["events"]) == sorted(
        (s, k) for s in range(2) for k in "FB" for _ in range(8)
    )
    assert timeline["theoretical_bubble"] == pytest.approx(1 / 9)
    assert 0.0 < timeline["measured_bubble"] < 1.0
    assert job.grep(r"pipeline timeline of iteration 4 written to .*bubble measured")
    png = tmp_path / f"timeline-{schedule}.png"
    plot_timelines([timeline], png)
    assert png.stat().st_size > 10_000
