# Sourced at the top of every lab sbatch script:  source "$LAB_ROOT/sites/job-env.sh"
# Loads the site profile ($LAB_SITE, default "local"), its modules and Python environment, and
# exports what the launch lines use:
#   LAB_CODE            the entry scripts (code/)
#   LAB_BACKEND         nccl or gloo
#   LAB_PROCS_PER_NODE  processes per node (torchrun --nproc-per-node)
#   MASTER_ADDR         first node of the allocation (rendezvous host)
#   MASTER_PORT         20000 + job id modulo 20000: two jobs on one node differ unless their ids
#                       are a multiple of 20,000 apart (then the second fails to bind, and says so)
#   SRUN_CPUS_PER_TASK  the batch script's --cpus-per-task, passed on to every srun in it
#   OMP_NUM_THREADS     threads of one task: its CPUs (torchrun's workers share them, see below)
#                       (both only when the script asks for --cpus-per-task)
: "${LAB_ROOT:?LAB_ROOT is not set: submit with distlab.jobs or export LAB_ROOT=<repository root>}"
export LAB_SITE="${LAB_SITE:-local}"
lab_profile="$LAB_ROOT/sites/$LAB_SITE.sh"
source "$lab_profile" || { echo "job-env: no site profile $lab_profile" >&2; exit 1; }
for lab_var in LAB_PROCS_PER_NODE LAB_BACKEND; do
    if [ -z "${!lab_var:-}" ]; then echo "job-env: $lab_var is not set: add it to $lab_profile" >&2; exit 1; fi
done
if [ -n "${LAB_MODULES:-}" ]; then module load $LAB_MODULES || exit 1; fi
if [ -n "${LAB_CONDA_ENV:-}" ]; then
    # a batch shell is not interactive: conda's shell functions come from its hook, not ~/.bashrc
    eval "$(conda shell.bash hook)" && conda activate "$LAB_CONDA_ENV" || exit 1
elif [ -n "${LAB_VENV:-}" ]; then source "$LAB_VENV/bin/activate" || exit 1; fi
export LAB_CODE="$LAB_ROOT/code"
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
# CPUs: Slurm 22.05 and 23.02 (Debian 12 ships 22.05) do not let srun inherit --cpus-per-task from
# sbatch, so each step would get one CPU per task; SRUN_CPUS_PER_TASK hands the request on. Up to
# 21.08 and from 23.11 srun reads SLURM_CPUS_PER_TASK again (23.11 no longer reads SRUN_CPUS_PER_TASK),
# which sbatch already exports. A task that starts
# several ranks (torchrun) shares its CPUs among them: distlab caps each worker's threads at its
# share of the cores it may use (distlab.rank_process.cap_cpu_threads). A script that asks for no
# CPUs gets Slurm's default (one per task) and PyTorch's own thread count.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK" OMP_NUM_THREADS="$SLURM_CPUS_PER_TASK"
else
    unset SRUN_CPUS_PER_TASK   # the notebook's value is for interactive srun, not for this job
fi
export PYTHONUNBUFFERED=1
echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: site=$LAB_SITE backend=$LAB_BACKEND procs/node=$LAB_PROCS_PER_NODE master=$MASTER_ADDR:$MASTER_PORT cpus/task=${SLURM_CPUS_PER_TASK:-default}"
