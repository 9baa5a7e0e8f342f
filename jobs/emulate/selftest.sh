#!/usr/bin/env bash
# jobs/emulate/selftest.sh: the emulated cluster from up to down, with mpidl on it (CI runs it).
#
#   jobs/emulate/selftest.sh          # as root, with the virtualenv of mpidl active
#
#  1. installs iproute2 if ip or tc is missing (Debian/Ubuntu);
#  2. brings 2 nodes up with 1 Gbit/s links (up checks them: a 4 MiB MPI
#     ping-pong within 15 % of the rate, the bytes counted on each link),
#     refuses a second up, checks again, and changes the rate to 100 Mbit/s
#     and back (shape, checked each time);
#  3. runs on 2 nodes x 2 ranks: `mpidl info` (must report 2 nodes, 2 ranks
#     each) and a short `mpidl train` with every algorithm and the peers (DDP; Horovod where installed)
#     (each must finish with a test accuracy);
#  4. runs a job whose ranks start a process in a session of its own and
#     sleep: past `run --timeout`, on SIGTERM and on Ctrl-C (SIGINT) it must be
#     ended on both nodes, nothing of it left in their namespaces;
#  5. takes the cluster down and looks, independently of cluster.py, for
#     anything left: namespaces, links, /etc/netns entries, the record;
#  6. brings 8 nodes up and runs the heterogeneity smoke test (scale.py --smoke:
#     8 paced workers, one 4x slow, AllReduce-SGD and AD-PSGD on numpy, one short epoch
#     of Fashion-MNIST, under SMOKE_TIMEOUT seconds, default 420), then takes
#     them down and looks once more.
# Exit status 0 when all of it passed. The cluster is taken down on failure
# or interrupt too, if this script brought it up. Each MPI job is bounded by
# a timeout (JOB_TIMEOUT seconds, default 240).
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cluster=$here/cluster.py
JOB_TIMEOUT=${JOB_TIMEOUT:-240}
SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-420}
export TQDM_DISABLE=1

fail() {
    echo "selftest: FAILED: $*" >&2
    exit 1
}
step() { echo "== selftest: $*"; }

ours=0  # 1 while a cluster that this script brought up may be there
cleanup() {
    if ((ours)); then "$cluster" down || true; fi
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# Nothing of the cluster's may be there: no namespace, link, /etc/netns entry, record.
nothing_left() {
    local left
    left=$({
        ip netns list | awk '$1 ~ /^node[0-9]+$/ {print "netns " $1}'
        ip -o link show | awk -F': ' '$2 ~ /^(mpidlbr0|veth-node[0-9]+)(@|$)/ {print "link " $2}'
        ls -d /etc/netns/node* /run/mpidl-emulate.json 2>/dev/null || true
    })
    [[ -z $left ]] || fail "left after down: $left"
    echo "nothing left"
}

# No process in the nodes' namespaces (after a job that was ended: $1 says how).
nothing_on_nodes() {
    local left
    left=$(ip netns pids node1; ip netns pids node2)
    [[ -z $left ]] || fail "$1: processes left on the nodes: $(ps -o pid=,args= -p "${left//$'\n'/,}")"
}

# Run an MPI job on the cluster, bounded, its output kept in $out.
on_cluster() {
    local status=0
    out=$(timeout -k 10 "$JOB_TIMEOUT" "$cluster" run "$@" 2>&1) || status=$?
    echo "$out"
    ((status == 0)) || fail "'cluster.py run $*' exited with $status"
}

if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    step "installing iproute2"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 >/dev/null ||
        { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 >/dev/null; }
fi
command -v mpiexec >/dev/null || fail "no mpiexec on PATH: activate the virtualenv that has mpidl and the mpich wheel"
command -v mpidl >/dev/null || fail "no mpidl on PATH: activate the virtualenv that has mpidl"
"$cluster" status >/dev/null && fail "a cluster is up already; take it down first (cluster.py down)"

step "up: 2 nodes, 1 Gbit/s links"
ours=1
"$cluster" up --nodes 2 --rate 1gbit
"$cluster" status
step "a second up is refused"
if "$cluster" up --nodes 2; then fail "a second up was not refused"; fi
step "check, shape to 100 Mbit/s and back"
"$cluster" check
"$cluster" shape --rate 100mbit
"$cluster" shape --rate 1gbit

step "mpidl info on 2 nodes x 2 ranks"
on_cluster -n 2 -- mpidl info
grep -E '^nodes +2$' <<<"$out" >/dev/null || fail "mpidl info does not report 2 nodes"
grep -E '^ranks per node +2 2$' <<<"$out" >/dev/null || fail "mpidl info does not report 2 ranks per node"
peers=ddp
if python3 -c "import horovod.torch" 2>/dev/null; then peers="ddp horovod"; fi
for algorithm in allreduce dpsgd lsgd adpsgd grsgd prague $peers; do
    step "mpidl train --algorithm $algorithm on 2 nodes x 2 ranks"
    # mpidl's algorithms on numpy (what crosses the links is the same; 4 imports of torch
    # cost some 5 s a run on 2 cores); the peers are torch's
    backend=(--backend numpy)
    if [[ $algorithm == ddp || $algorithm == horovod ]]; then backend=(); fi
    on_cluster -n 2 -- mpidl train --algorithm "$algorithm" "${backend[@]}" --dataset digits --hidden 16 --epochs 1 --no-progress
    grep '^final: test accuracy' <<<"$out" >/dev/null || fail "mpidl train $algorithm printed no final accuracy"
done

step "a job past run --timeout, or stopped by SIGTERM or Ctrl-C, is ended on both nodes"
escape="import subprocess, time; subprocess.Popen(['sleep', '300'], start_new_session=True); time.sleep(300)"
status=0
"$cluster" run --timeout 5 -n 2 -- python3 -c "$escape" >/dev/null 2>&1 || status=$?
((status == 124)) || fail "a job past --timeout exited with $status, not 124"
nothing_on_nodes "past --timeout"
for sig in TERM INT; do
    status=0
    timeout -s "$sig" -k 15 5 "$cluster" run -n 2 -- python3 -c "$escape" >/dev/null 2>&1 || status=$?
    ((status == 124)) || fail "cluster.py run did not end on SIG$sig by itself (exit $status)"
    nothing_on_nodes "SIG$sig"
done
echo "nothing left on the nodes"

step "down"
"$cluster" down
ours=0
nothing_left
"$cluster" down  # nothing to do: no error

step "up again: 8 nodes; the heterogeneity smoke test (8 paced workers, one 4x slow, one short epoch)"
ours=1
"$cluster" up --nodes 8 --rate 1gbit
smoke=$(mktemp -d)
status=0
timeout -k 10 "$SMOKE_TIMEOUT" "$here/scale.py" --smoke --out "$smoke" --timeout "$JOB_TIMEOUT" || status=$?
((status == 0)) || fail "scale.py --smoke exited with $status"
python3 - "$smoke/table.csv" <<'PY' || fail "the smoke test's table lacks a row or an accuracy"
import csv, sys
rows = {r["algorithm"]: r for r in csv.DictReader(open(sys.argv[1]))}
assert set(rows) == {"allreduce", "adpsgd"}, rows
for name, row in rows.items():
    assert float(row["final acc %"]) > 50, (name, row)
    print(f"{name}: final accuracy {row['final acc %']} %, steps/s {row['steps/s']}")
PY
rm -rf "$smoke"
"$cluster" down
ours=0
nothing_left
step "passed"
