"""Pretrain a GPT with Megatron-LM's arguments and log lines (data, tensor and pipeline parallelism).

Prepare the data once (offline: a tokenizer and a corpus from the Python standard library)::

    python code/train_tokenizer.py --output-dir data/gpt --vocab-size 4096
    python code/preprocess_data.py --input data/gpt/stdlib_docstrings.jsonl --output-prefix data/gpt/stdlib \\
        --vocab-file data/gpt/vocab.json --merge-file data/gpt/merges.txt --append-eod

Arguments of a tiny run (``ARGS`` below; global batch 8 = micro 2 x data-parallel 4 x accumulation 1)::

    ARGS="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
      --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 50 \\
      --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.1 \\
      --data-path data/gpt/stdlib_text_document --tokenizer-type GPT2BPETokenizer --vocab-file data/gpt/vocab.json \\
      --merge-file data/gpt/merges.txt --split 949,50,1 --log-interval 10 --eval-interval 25 --eval-iters 2"

One process::

    python code/pretrain_gpt.py $ARGS

One node, 4 processes (torchrun; OMP_NUM_THREADS is capped to the usable cores anyway)::

    torchrun --standalone --nproc-per-node=4 code/pretrain_gpt.py $ARGS

Two nodes x 2 processes from Slurm (what the course's sbatch scripts do)::

    srun torchrun --nnodes=$SLURM_NNODES --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID code/pretrain_gpt.py $ARGS

Legacy launcher, run once per node with its --node_rank (it passes --local-rank, accepted)::

    python -m torch.distributed.launch --nproc_per_node=2 --nnodes=2 --node_rank=0 \\
        --master_addr=node1 --master_port=29500 code/pretrain_gpt.py $ARGS

The course's exercise layout, tensor parallel 2 x pipeline parallel 2 over 2 nodes x 2 GPUs
(rank order tp-dp-pp: each node holds one pipeline stage, its two GPUs one tensor-parallel pair)::

    srun torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID code/pretrain_gpt.py $ARGS \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule 1f1b \\
        --pipeline-timeline runs/gpt/timeline.json    # plot: distlab.gpt.pipeline_parallel.plot.plot_timelines

Restarts: when a rank dies, torchrun stops the others and starts all of them again, up to
--max-restarts times. With --load equal to --save the new attempt resumes from the latest
checkpoint by itself and says so ("> restart 1 of torchrun's --max-restarts 2: resuming from
iteration 6, ..."); the iterations after that checkpoint are recomputed, to the same losses::

    torchrun --standalone --nproc-per-node=4 --max-restarts 2 code/pretrain_gpt.py $ARGS \\
        --save runs/gpt/ckpt --load runs/gpt/ckpt --save-interval 10

One srun task per rank, without torchrun (ranks from SLURM_PROCID)::

    srun --ntasks-per-node=2 python code/pretrain_gpt.py $ARGS

Open MPI's mpirun, once for all nodes (ranks from OMPI_COMM_WORLD_*; over ssh, outside Slurm and
PBS, a remote rank knows the rendezvous only from -x, and refuses to start without it)::

    mpirun -np 4 --hostfile hostfile -bind-to none -x MASTER_ADDR=node1 -x MASTER_PORT=29500 -x PATH \
        python code/pretrain_gpt.py $ARGS

DeepSpeed ZeRO (data parallelism only; the JSON's batch keys are filled from the run and must
obey train_batch_size = micro x accumulation x world size), launched as above or by DeepSpeed's
own launcher from a hostfile (``node1 slots=2`` per line), which exports the ``VAR=value`` lines of
~/.deepspeed_env and ./.deepspeed_env (DS_ENV_FILE renames them) to every node::

    srun torchrun ... code/pretrain_gpt.py $ARGS --deepspeed --deepspeed_config ds_config.json --zero-stage 2
    deepspeed --hostfile hostfile code/pretrain_gpt.py $ARGS --deepspeed --deepspeed_config ds_config.json

No files at all: Megatron's mock GPT documents and NullTokenizer, as Megatron-LM's Llama 3
example script runs them (its flags: tests/megatron_example_scripts.py), in samples instead of
iterations (8 iterations of 4 samples)::

    python code/pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --micro-batch-size 1 --global-batch-size 4 --train-samples 32 --lr-warmup-samples 8 --lr 1.5e-4 \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --split 99,1,0 --log-throughput

A memory budget on a GPU (the sweep of notebook 07 fails at the same micro batch on any card)::

    python code/pretrain_gpt.py $ARGS --micro-batch-size 16 --device-memory-gib 16
"""

from __future__ import annotations

import os
import sys

from distlab.gpt.arguments import ArgumentError
from distlab.gpt.pretrain import OutOfMemory, pretrain


def main() -> int:
    try:
        pretrain(sys.argv[1:])
    except ArgumentError as exc:
        print(f"pretrain_gpt.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except OutOfMemory as exc:
        print(exc, file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    # End as multiprocessing ends its children, without interpreter finalisation: DeepSpeed's
    # ZeRO-3 keeps the model, and with it the process groups, in module-level caches, and a gloo
    # thread that frees a tensor while the interpreter finalises aborts a run that went well
    # ("terminate called without an active exception"). Everything was written and closed.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
