# Site profile "example-gpu": a template for a real GPU cluster. Copy it to sites/<yours>.sh,
# fill in the values your cluster's documentation gives, and `export LAB_SITE=<yours>` before
# starting JupyterLab. The notebooks stay as they are. Check it with `LAB_SITE=<yours> ./lab test`
# on a login node. The repository, the Python environment, data/ and the notebooks' jobs/ folders
# must be on a file system that the compute nodes see (home or project space, not /tmp).

export SBATCH_PARTITION=gpu            # partition with GPU nodes
export SBATCH_ACCOUNT=my-project       # project / account to charge
export SBATCH_TIMELIMIT=00:30:00       # time limit of a lab job
export SBATCH_GPUS_PER_NODE=4          # GPUs per node
# export SBATCH_QOS=normal             # quality of service, where the cluster has several
# export SBATCH_RESERVATION=course     # a reservation the centre made for the course days
export SRUN_CPUS_PER_TASK=8            # CPUs of each task of `srun` typed in a notebook cell
                                       # (batch scripts ask with --cpus-per-task: 8 per rank,
                                       # 32 per torchrun task of up to 4 ranks)
export LAB_PROCS_PER_NODE=4            # one process per GPU
export LAB_MODULES="cuda/12.4 nccl"    # modules that jobs load (`module load $LAB_MODULES`)
export LAB_VENV="$LAB_ROOT/.venv"      # or a conda env made from environment.yml: LAB_CONDA_ENV=distlab
export LAB_BACKEND=nccl                # NCCL between GPUs
export LAB_CIFAR_SOURCE=download       # the login node has internet: notebook 03 uses the real CIFAR-10
export NCCL_DEBUG=WARN                 # INFO prints the rings and the transport NCCL picked
# export NCCL_SOCKET_IFNAME=ib0        # the interface for NCCL's bootstrap, if several exist
# export NCCL_IB_HCA=mlx5              # InfiniBand adapters to use
# Hangs (notebook 12): NCCL's flight recorder. Each rank keeps its last TORCH_FR_BUFFER_SIZE
# collectives; when one times out, NCCL's watchdog writes them to TORCH_FR_DUMP_TEMP_FILE<rank>, the
# files the engine's hang report, code/diagnose_hang.py and PyTorch's `torchfrtrace` read (the
# engine's own default folder, made here: the watchdog does not make it). Not run on a GPU here yet.
export TORCH_FR_BUFFER_SIZE=2000
export TORCH_NCCL_DUMP_ON_TIMEOUT=1
if [ -n "${SLURM_JOB_ID:-}" ]; then
  export TORCH_FR_DUMP_TEMP_FILE="$PWD/flight_recorder_$SLURM_JOB_ID/rank_"
  mkdir -p "${TORCH_FR_DUMP_TEMP_FILE%/*}"
fi
