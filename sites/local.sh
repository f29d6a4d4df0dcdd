# Site profile "local": the Slurm mini-cluster on this machine (the default).
#
# A site profile is a shell file of exports, sourced twice:
#   - at submission (distlab.jobs.submit): the SBATCH_* variables act like #SBATCH lines but
#     take precedence over them, so one sbatch script fits every cluster;
#   - inside every job (sites/job-env.sh): modules, Python environment, backend, NCCL.
# Copy sites/example-gpu.sh to write one for your cluster, then `export LAB_SITE=<name>`.

export SBATCH_PARTITION=lab            # the local cluster's only partition
export SBATCH_TIMELIMIT=00:15:00       # default time limit of a lab job
export SBATCH_GPUS_PER_NODE=2          # gpu:2 is a scheduling token here: jobs run on the CPU
export SRUN_CPUS_PER_TASK=1            # CPUs of each task of `srun` typed in a notebook cell
export LAB_PROCS_PER_NODE=2            # processes per node (GPUs per node on a GPU cluster)
export LAB_NODES_SHARE_CORES=1         # both nodes are this machine: a rank's share of the cores counts both
export LAB_MODULES=""                  # `module load` these in jobs (none here)
export LAB_VENV="$LAB_ROOT/.venv"      # Python environment that jobs activate
export LAB_BACKEND=gloo                # torch.distributed backend: no CUDA on the local cluster
export LAB_CIFAR_SOURCE=generate       # no internet: notebook 03 generates a CIFAR-10 stand-in
