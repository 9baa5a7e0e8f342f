#!/bin/bash
# mpidl without Slurm: `mpirun` on this machine, or on the hosts of a hostfile.
# It runs `mpidl info`, then the benchmark or a training run.
#
#   jobs/mpirun.sh                                        # bench, 4 ranks here
#   NP=8 HOSTFILE=jobs/hostfile.example jobs/mpirun.sh    # bench over two hosts
#   WHAT=train ALGORITHM=lsgd NP=4 jobs/mpirun.sh
#
# With a hostfile, mpirun starts the remote ranks over ssh: every host needs
# passwordless ssh from this one and mpidl's environment at the same path
# (e.g. MPIDL_VENV on a shared filesystem). MPICH hostfile lines are
# "host:ranks"; Open MPI's are "host slots=ranks" (jobs/hostfile.example).
#
# Environment knobs (MPIDL_VENV, MPIDL_MODULES, MPIRUN_ARGS, OUTDIR, ...): jobs/common.sh.
set -euo pipefail

# Knobs: environment variables override these defaults; an empty one is left to mpidl.
WHAT=${WHAT:-bench}             # bench | train | info
NP=${NP:-4}                     # ranks
HOSTFILE=${HOSTFILE:-}          # empty: every rank on this machine
LAUNCH_TIMEOUT=${LAUNCH_TIMEOUT:-1h}  # each launch is stopped after this (timeout(1) syntax); 0: never
# bench
SIZES=${SIZES:-4K,16K,64K,256K,1M,4M,16M,64M}
COLLECTIVES=${COLLECTIVES:-${ALGORITHMS:-all}}  # all-reduce algorithms (ALGORITHMS: the old name, deprecated)
DTYPE=${DTYPE:-float32}
REPEAT=${REPEAT:-11}
# train
ALGORITHM=${ALGORITHM:-dpsgd}   # any --algorithm that `mpidl train --help` lists: allreduce dpsgd lsgd ...
TOPOLOGY=${TOPOLOGY:-}          # only for algorithms with a graph (dpsgd)
EPOCHS=${EPOCHS:-10}
LR=${LR:-}
SEED=${SEED:-0}
DATASET=${DATASET:-digits}      # digits needs scikit-learn
SLOW=${SLOW:-}                  # RANK:FACTOR
PLOT=${PLOT:-1}
TRAIN_OPTIONS=${TRAIN_OPTIONS:-}  # more mpidl train options, word-split
LAUNCHER=mpirun

# shellcheck source=jobs/common.sh
source "$(dirname "$0")/common.sh"

mpidl_setup
case $WHAT in
    info) mpidl_launch mpidl info ;;
    bench)
        [[ -z ${ALGORITHMS:-} ]] || echo "ALGORITHMS is deprecated (removed in the next release): use COLLECTIVES" >&2
        mpidl_launch mpidl info
        mpidl_launch mpidl bench --sizes "$SIZES" --collectives "$COLLECTIVES" --dtype "$DTYPE" --repeat "$REPEAT" \
            --json "$OUTDIR/bench.json" --csv "$OUTDIR/bench.csv"
        ;;
    train)
        mpidl_require_train
        mpidl_launch mpidl info
        mpidl_train_args "$ALGORITHM"
        mpidl_launch mpidl train "${TRAIN_ARGS[@]}"
        ;;
    *) mpidl_die "WHAT=$WHAT: use bench, train or info" ;;
esac
