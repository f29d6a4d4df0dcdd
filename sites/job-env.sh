# Sourced at the top of every lab sbatch script:  source "$LAB_ROOT/sites/job-env.sh"
# Loads the site profile ($LAB_SITE, default "local"), its modules and Python environment, and
# exports what the launch lines use:
#   LAB_CODE            the entry scripts (code/)
#   LAB_BACKEND         nccl or gloo
#   LAB_PROCS_PER_NODE  processes per node (torchrun --nproc-per-node)
#   MASTER_ADDR         first node of the allocation (rendezvous host)
#   MASTER_PORT         a port derived from the job id (no two jobs collide)
: "${LAB_ROOT:?LAB_ROOT is not set: submit with distlab.jobs or export LAB_ROOT=<repository root>}"
export LAB_SITE="${LAB_SITE:-local}"
source "$LAB_ROOT/sites/$LAB_SITE.sh" || { echo "job-env: no site profile $LAB_ROOT/sites/$LAB_SITE.sh" >&2; exit 1; }
if [ -n "${LAB_MODULES:-}" ]; then module load $LAB_MODULES || exit 1; fi
if [ -n "${LAB_CONDA_ENV:-}" ]; then conda activate "$LAB_CONDA_ENV" || exit 1
elif [ -n "${LAB_VENV:-}" ]; then source "$LAB_VENV/bin/activate" || exit 1; fi
export LAB_CODE="$LAB_ROOT/code"
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
export PYTHONUNBUFFERED=1
echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: site=$LAB_SITE backend=$LAB_BACKEND procs/node=$LAB_PROCS_PER_NODE master=$MASTER_ADDR:$MASTER_PORT"
