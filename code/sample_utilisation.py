"""Sample this node's utilisation beside a training job: one CSV per node (distlab.profiling.utilisation).

In a batch script, one sampler per node, started before training and stopped after it::

    UTIL=runs/util/$SLURM_JOB_ID
    srun --overlap --ntasks-per-node=1 python $LAB_CODE/sample_utilisation.py \\
        --output-dir $UTIL --stop-file $UTIL/STOP --interval 0.5 &
    srun --ntasks-per-node=1 torchrun ... $LAB_CODE/pretrain_gpt.py ...
    touch $UTIL/STOP; wait

``--overlap`` lets the sampler share the CPUs and GPUs that training's step asks for (where the
site constrains devices with cgroups, add the step's ``--gpus-per-node`` so that NVML sees them).
Slurm ends the sampler with the job in any case; the stop file only ends it cleanly and sooner.

Locally, without Slurm (it stops after --max-seconds, or with its parent shell)::

    python code/sample_utilisation.py --output-dir runs/util/local --max-seconds 30
"""

import argparse

from distlab.profiling.utilisation import SamplerConfig, sample


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output-dir", required=True, help="folder for <node>.csv")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--stop-file", default=None, help="stop once this file exists")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop after this long at the latest")
    args = parser.parse_args()
    cfg = SamplerConfig(args.output_dir, args.interval, args.stop_file, args.max_seconds)
    print(f"{cfg.node}: sampling every {cfg.interval} s into {cfg.output_dir}/{cfg.node}.csv", flush=True)
    path = sample(cfg)
    print(f"{cfg.node}: sampler stopped, {path} written", flush=True)


if __name__ == "__main__":
    main()
