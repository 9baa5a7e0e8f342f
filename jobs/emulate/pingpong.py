#!/usr/bin/env python3
"""Ping-pong between the nodes of the emulated cluster; ``cluster.py check`` runs it.

One rank per node. For each pair of ranks given with ``--pairs``, in turn, the
first rank sends ``--bytes`` to the second, which sends the same buffer back:
one round trip to warm up (connections, first touch of the buffers), then
timed round trips until ``--seconds`` have passed (at least ``--min-rounds``).
Ranks outside the pair wait in a sleeping barrier, so that they take no CPU
from the pair on a small machine. The buffer that comes back must equal the
one sent.

Rank 0 prints one JSON object on stdout::

    {"hosts": [hostname of each rank], "nodes": nodes that MPI sees,
     "pairs": [{"ranks": [a, b], "bytes": n, "one_way_s": [...], "intact": true}]}

``nodes`` counts the groups of ranks that share memory (``COMM_TYPE_SHARED``):
ranks in different namespaces must not, or their messages would not cross the
links. ``one_way_s`` holds half of each timed round trip.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import time

from mpi4py import MPI

#: Round trips timed at most per pair, however fast they are.
MAX_ROUNDS = 100


def sleeping_barrier(comm: MPI.Comm) -> None:
    """Wait for every rank without spinning a core."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


def round_trip(comm: MPI.Comm, peer: int, buf: bytearray, first: bool) -> float:
    """One round trip of ``buf`` with ``peer`` (``first`` sends first); its seconds."""
    start = MPI.Wtime()
    if first:
        comm.Send(buf, dest=peer)
        comm.Recv(buf, source=peer)
    else:
        comm.Recv(buf, source=peer)
        comm.Send(buf, dest=peer)
    return MPI.Wtime() - start


def measure(comm: MPI.Comm, a: int, b: int, nbytes: int, seconds: float, min_rounds: int) -> dict[str, object] | None:
    """Ping-pong between ranks ``a`` and ``b``; rank ``a`` returns the result, the others None."""
    rank = comm.Get_rank()
    result = None
    if rank in (a, b):
        first = rank == a
        peer = b if first else a
        sent = os.urandom(nbytes)
        buf = bytearray(sent) if first else bytearray(nbytes)
        warm = round_trip(comm, peer, buf, first)
        if first:
            rounds = min(MAX_ROUNDS, max(min_rounds, math.ceil(seconds / max(warm, 1e-6))))
            comm.send(rounds, dest=peer)
        else:
            rounds = comm.recv(source=peer)
        one_way = [round_trip(comm, peer, buf, first) / 2 for _ in range(rounds)]
        if first:
            result = {"ranks": [a, b], "bytes": nbytes, "one_way_s": one_way, "intact": bytes(buf) == sent}
    sleeping_barrier(comm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", required=True, help="pairs of ranks, e.g. 0-1,2-3")
    parser.add_argument("--bytes", type=int, default=4 << 20, help="message size (default 4 MiB)")
    parser.add_argument("--seconds", type=float, default=0.5, help="time the round trips of a pair take at least")
    parser.add_argument("--min-rounds", type=int, default=3, help="timed round trips per pair at least")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    pairs = [tuple(int(r) for r in pair.split("-")) for pair in args.pairs.split(",")]
    results = [measure(comm, a, b, args.bytes, args.seconds, args.min_rounds) for a, b in pairs]
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leaders = comm.gather(shared.bcast(comm.Get_rank(), root=0), root=0)
    hosts = comm.gather(socket.gethostname(), root=0)
    everyone = comm.gather(results, root=0)
    if everyone is not None and leaders is not None:  # rank 0
        found = [next(mine[i] for mine in everyone if mine[i] is not None) for i in range(len(pairs))]
        print(json.dumps({"hosts": hosts, "nodes": len(set(leaders)), "pairs": found}), flush=True)


if __name__ == "__main__":
    main()
