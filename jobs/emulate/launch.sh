#!/bin/sh
# jobs/emulate/launch.sh: hydra's "ssh" into the nodes of the emulated cluster.
# `cluster.py run` hands it to MPICH's mpiexec:
#
#     mpiexec -launcher ssh -launcher-exec jobs/emulate/launch.sh -hosts node1:2,node2:2 ...
#
# Called the way ssh is, `launch.sh [SSH OPTIONS] NODE COMMAND...`, it runs
# COMMAND (its words joined by spaces and read by sh, as ssh does) in the
# network namespace NODE and in a UTS namespace of its own whose hostname is
# NODE. The environment passes through unchanged. SSH options are skipped.
set -eu
while [ $# -gt 0 ]; do
    case $1 in
        -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;  # the ssh options that take an argument
        --) shift; break ;;
        -*) shift ;;
        *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "usage: $0 [SSH OPTIONS] NODE COMMAND..." >&2
    exit 255
fi
node=$1
shift
case $node in
    '' | *[!A-Za-z0-9_.-]*) echo "$0: '$node' is not a node name" >&2; exit 255 ;;
esac
if [ ! -e "/run/netns/$node" ]; then
    echo "$0: no node '$node' (no network namespace of that name; is the cluster up?)" >&2
    exit 255
fi
# shellcheck disable=SC2016  # $1 and $2 belong to the inner sh
exec ip netns exec "$node" unshare --uts sh -c 'hostname "$1" && exec sh -c "$2"' launch.sh "$node" "$*"
