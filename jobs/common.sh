# shellcheck shell=bash
# jobs/common.sh: sourced by the scripts in jobs/, not run on its own.
# It loads the environment that has mpidl in it and picks the launcher.
#
# Environment: where mpidl comes from. Set these in your shell before
# `sbatch` (sbatch hands your environment to the job) or change the defaults
# below for your site. They are applied in this order; each may be empty.
#   MPIDL_MODULES  modules to `module load` first, e.g. "gcc/12 openmpi/4.1.6 python/3.11"
#   MPIDL_SETUP    a shell file to source, e.g. one that runs `conda activate mpidl`
#   MPIDL_VENV     a virtualenv with mpidl installed; its bin/activate is sourced
# With all three empty, whatever `mpidl` is on PATH is used.
#
# Launcher: how the ranks are started.
#   LAUNCHER       srun     srun --mpi=$SRUN_MPI (default inside a Slurm job)
#                  mpiexec  the MPI library's mpiexec inside the allocation; it
#                           reads the node list from Slurm by itself
#                  mpirun   mpirun with a hostfile, no Slurm (default outside Slurm)
#   NP             ranks for mpirun (inside Slurm the allocation decides)
#   HOSTFILE       hostfile for mpirun; MPICH: "host:slots" lines, Open MPI:
#                  "host slots=N" lines; empty: all NP ranks on this machine
#   SRUN_MPI       srun's PMI: pmi2 (MPICH, the mpich wheel, Intel MPI, MVAPICH);
#                  pmix for an Open MPI built with PMIx (not for the mpich wheel)
#   SRUN_ARGS, MPIEXEC_ARGS, MPIRUN_ARGS   extra launcher options (word-split)
#   ON_FAILURE     what a worker's death does: abort (mpidl's default: the job ends) or
#                  continue (`mpidl train --on-failure continue`: AD-PSGD, Prague and
#                  GR-SGD go on with the survivors). continue needs Open MPI's ULFM and
#                  its launcher: LAUNCHER=mpiexec or mpirun, given --with-ft ulfm --mca
#                  async_mpi_finalize 1 here; not srun (Open MPI detects a death in
#                  its own launcher's runtime: docs/failures.rst)
#   LAUNCH_TIMEOUT each launch (mpidl info, the benchmark, one training run) is
#                  stopped after this long (timeout(1) syntax: 900, 30m, 2h; SIGTERM,
#                  SIGKILL 30 s later) and fails with exit status 124. Default 0: no
#                  limit of its own, the Slurm job's --time limits it; mpirun.sh,
#                  which has no such limit, sets 1h
#   OMP_NUM_THREADS  threads per rank for numpy/torch; default: Slurm's
#                  cpus-per-task, else 1 (more would oversubscribe the cores)
#
# Output:
#   OUTDIR         where the result files go; default
#                  $SLURM_SUBMIT_DIR/results/<job name>-<job id>. On several
#                  nodes rank 0 writes them on the first node, which is where
#                  the batch script runs.

MPIDL_MODULES=${MPIDL_MODULES:-}
MPIDL_SETUP=${MPIDL_SETUP:-}
MPIDL_VENV=${MPIDL_VENV:-}
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    LAUNCHER=${LAUNCHER:-srun}
else
    LAUNCHER=${LAUNCHER:-mpirun}
fi
NP=${NP:-4}
SRUN_MPI=${SRUN_MPI:-pmi2}
HOSTFILE=${HOSTFILE:-}
SRUN_ARGS=${SRUN_ARGS:-}
MPIEXEC_ARGS=${MPIEXEC_ARGS:-}
MPIRUN_ARGS=${MPIRUN_ARGS:-}
LAUNCH_TIMEOUT=${LAUNCH_TIMEOUT:-0}
ON_FAILURE=${ON_FAILURE:-}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# Progress bars only on a terminal; in a job's output file they are noise.
if [[ ! -t 2 ]]; then export TQDM_DISABLE=${TQDM_DISABLE:-1}; fi
OUTDIR=${OUTDIR:-${SLURM_SUBMIT_DIR:-$PWD}/results/${SLURM_JOB_NAME:-mpidl}-${SLURM_JOB_ID:-$(date +%Y%m%d-%H%M%S)}}

mpidl_die() {
    echo "mpidl job: error: $*" >&2
    exit 2
}

# Load the environment, check that mpidl runs, print what the job is.
mpidl_setup() {
    local f
    # Site scripts (module, conda) often read unset variables: no `set -u` while they run.
    set +u
    if [[ -n $MPIDL_MODULES ]]; then
        if ! command -v module >/dev/null 2>&1; then  # batch shells do not always read the login profile
            for f in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do
                # shellcheck disable=SC1090
                if [[ -f $f ]]; then source "$f"; fi
            done
        fi
        command -v module >/dev/null 2>&1 || mpidl_die "MPIDL_MODULES is set but there is no 'module' command"
        # shellcheck disable=SC2086  # a list of module names
        module load $MPIDL_MODULES
    fi
    if [[ -n $MPIDL_SETUP ]]; then
        # shellcheck disable=SC1090
        source "$MPIDL_SETUP"
    fi
    if [[ -n $MPIDL_VENV ]]; then
        [[ -f $MPIDL_VENV/bin/activate ]] || mpidl_die "MPIDL_VENV=$MPIDL_VENV is not a virtualenv (no bin/activate)"
        # shellcheck disable=SC1091
        source "$MPIDL_VENV/bin/activate"
    fi
    set -u
    command -v mpidl >/dev/null 2>&1 ||
        mpidl_die "no 'mpidl' on PATH; set MPIDL_VENV (or MPIDL_MODULES / MPIDL_SETUP), see jobs/README.rst"
    case $LAUNCHER in
        srun | mpiexec) [[ -n ${SLURM_JOB_ID:-} ]] || mpidl_die "LAUNCHER=$LAUNCHER needs a Slurm job; use sbatch, or LAUNCHER=mpirun" ;;
        mpirun) ;;
        *) mpidl_die "LAUNCHER=$LAUNCHER: use srun, mpiexec or mpirun" ;;
    esac
    command -v "$LAUNCHER" >/dev/null 2>&1 || mpidl_die "launcher '$LAUNCHER' not found on PATH"
    case $ON_FAILURE in
        "" | abort) ;;
        continue)
            [[ $LAUNCHER != srun ]] ||
                mpidl_die "ON_FAILURE=continue needs Open MPI's mpiexec (LAUNCHER=mpiexec): Open MPI detects a death in its own launcher's runtime, not under srun (docs/failures.rst)" ;;
        *) mpidl_die "ON_FAILURE=$ON_FAILURE: use abort or continue" ;;
    esac
    mkdir -p "$OUTDIR"
    echo "== mpidl job $(date '+%F %T')"
    echo "job             ${SLURM_JOB_NAME:-(no Slurm)} ${SLURM_JOB_ID:-}"
    echo "batch host      $(hostname)"
    if [[ -n ${SLURM_JOB_ID:-} ]]; then
        echo "nodes           ${SLURM_JOB_NUM_NODES:-?} (${SLURM_JOB_NODELIST:-?})"
        echo "tasks           ${SLURM_NTASKS:-?} (per node: ${SLURM_TASKS_PER_NODE:-?})"
    else
        echo "ranks           $NP (hostfile: ${HOSTFILE:-none, this machine only})"
    fi
    echo "launcher        $LAUNCHER ($(command -v "$LAUNCHER"))"
    echo "launch timeout  $([[ $LAUNCH_TIMEOUT == 0 ]] && echo none || echo "$LAUNCH_TIMEOUT")"
    echo "on failure      ${ON_FAILURE:-abort}"
    echo "mpidl           $(command -v mpidl)"
    echo "python          $(command -v python)"
    echo "OMP_NUM_THREADS $OMP_NUM_THREADS"
    echo "results         $OUTDIR"
}

# mpidl_is_open_mpi LAUNCHER: true if LAUNCHER is Open MPI's.
mpidl_is_open_mpi() {
    "$1" --version 2>&1 | grep "Open MPI" >/dev/null  # not -q: pipefail
}

# mpidl_ulfm_args LAUNCHER: with ON_FAILURE=continue and Open MPI's LAUNCHER, add its ULFM
# options to cmd: the survivors of a death are told and go on, and MPI_Finalize skips its
# closing fence, where they could wait for a dead rank forever (docs/failures.rst). Other
# MPIs get nothing: mpidl says that ULFM is missing there, and a death ends the job.
mpidl_ulfm_args() {
    if [[ $ON_FAILURE == continue ]] && mpidl_is_open_mpi "$1"; then
        cmd+=(--with-ft ulfm --mca async_mpi_finalize 1)
    fi
}

# Run a command on every rank with the chosen launcher: mpidl_launch CMD [ARGS...]
mpidl_launch() {
    local cmd=()
    case $LAUNCHER in
        srun)
            # --kill-on-bad-exit: one failed rank ends the step instead of leaving the rest waiting.
            # shellcheck disable=SC2206
            cmd=(srun --mpi="$SRUN_MPI" --kill-on-bad-exit=1 $SRUN_ARGS)
            ;;
        mpiexec)
            # Hydra (MPICH) and Open MPI both take the nodes from the Slurm allocation.
            # shellcheck disable=SC2206
            cmd=(mpiexec -n "${SLURM_NTASKS:?not in a Slurm job}")
            mpidl_ulfm_args mpiexec
            # shellcheck disable=SC2206
            cmd+=($MPIEXEC_ARGS)
            ;;
        mpirun)
            cmd=(mpirun -n "$NP")
            mpidl_ulfm_args mpirun
            if [[ -n $HOSTFILE ]]; then
                [[ -f $HOSTFILE ]] || mpidl_die "HOSTFILE=$HOSTFILE does not exist"
                if mpidl_is_open_mpi mpirun; then
                    cmd+=(--hostfile "$HOSTFILE")
                else
                    cmd+=(-f "$HOSTFILE")
                fi
            fi
            # shellcheck disable=SC2206
            cmd+=($MPIRUN_ARGS)
            ;;
    esac
    local start=$SECONDS status=0
    echo "== $(date '+%T') ${cmd[*]} $*"
    # No stdin: timeout runs the launcher outside the terminal's foreground, where reading it would stop it.
    timeout -k 30 "$LAUNCH_TIMEOUT" "${cmd[@]}" "$@" </dev/null || status=$?
    echo "== exit $status after $((SECONDS - start)) s$( ((status == 124)) && echo " (LAUNCH_TIMEOUT=$LAUNCH_TIMEOUT reached)"): $*"
    return "$status"
}

# Stop with a clear message if this mpidl has no `train` command yet.
mpidl_require_train() {
    mpidl train --help >/dev/null 2>&1 ||
        mpidl_die "this mpidl ($(command -v mpidl)) has no 'train' command; install a version that has it"
}

# The algorithms this mpidl train offers, space-separated (from its --help).
mpidl_train_algorithms() {
    local choices
    choices=$(mpidl train --help | tr -d '\n' | sed -n 's/.*--algorithm {\([^}]*\)}.*/\1/p')
    [[ -n $choices ]] || mpidl_die "cannot read the algorithms from 'mpidl train --help'; set ALGORITHMS"
    echo "${choices//,/ }"
}

# The `mpidl train` options from the training knobs (ALGORITHM, TOPOLOGY, EPOCHS,
# LR, SEED, DATASET, SLOW, PLOT, TRAIN_OPTIONS) and ON_FAILURE into the array TRAIN_ARGS; empty
# knobs are left to mpidl's defaults; --no-progress unless stderr is a terminal.
# Results: $OUTDIR/train-<algorithm>.json (and .png).
mpidl_train_args() {
    local algorithm=$1
    TRAIN_ARGS=(--algorithm "$algorithm" --dataset "$DATASET" --json "$OUTDIR/train-$algorithm.json")
    if [[ -n $TOPOLOGY ]]; then TRAIN_ARGS+=(--topology "$TOPOLOGY"); fi
    if [[ -n $EPOCHS ]]; then TRAIN_ARGS+=(--epochs "$EPOCHS"); fi
    if [[ -n $LR ]]; then TRAIN_ARGS+=(--lr "$LR"); fi
    if [[ -n $SEED ]]; then TRAIN_ARGS+=(--seed "$SEED"); fi
    if [[ -n $SLOW ]]; then TRAIN_ARGS+=(--slow "$SLOW"); fi
    if [[ -n $ON_FAILURE ]]; then TRAIN_ARGS+=(--on-failure "$ON_FAILURE"); fi
    if [[ $PLOT == 1 ]]; then TRAIN_ARGS+=(--plot "$OUTDIR/train-$algorithm.png"); fi
    # shellcheck disable=SC2206  # a list of options
    TRAIN_ARGS+=($TRAIN_OPTIONS)
    if [[ ! -t 2 ]]; then TRAIN_ARGS+=(--no-progress); fi   # no progress bar in an output file
}
