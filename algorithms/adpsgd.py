"""AD-PSGD: asynchronous decentralized SGD, averaging atomically with one random neighbor.

Lian, Zhang, Zhang & Liu, "Asynchronous Decentralized Parallel Stochastic
Gradient Descent", ICML 2018. The graph is bipartite:
its two sides are the *active* workers (rank 0's side) and the *passive* ones,
and every edge joins an active worker to a passive one.

A step of worker i (its gradient g_i already computed by the caller):

* active: (1) wait for the averaging started at its previous step,
  x_i, x_j <- (x_i + x_j) / 2 with a passive neighbor j; it ran on a service
  thread while the caller computed g_i, so computation and communication
  overlap; (2) apply the local optimizer with g_i to the averaged model;
  (3) start the next averaging, with a neighbor drawn uniformly at random
  (seeded by (``seed``, rank)), or with ``partner="aware"`` chosen by place
  and measured speed (:class:`collectives.partial.placement.Placement`: a
  neighbor on its node first, one on another node every ``cross_every``-th
  averaging, over the link that cost least so far and in turns to every
  node; random among neighbors the rules do not tell apart). The costs are
  the worker's own averagings' times, so a slow link is avoided by the
  workers that saw it slow.
* passive: apply the local optimizer. A server thread answers the active
  neighbors' averaging requests whenever they come, whatever the worker is
  doing, so a slow passive worker does not slow its active neighbors, and a
  slow active worker slows no one.

Atomicity: each worker's parameters have a lock. A passive worker's server
holds it from receiving x_j to writing the average, and its optimizer step
takes it; an active worker's parameters are written only by its own
averaging thread and by its optimizer step, which first waits for that thread.
So every averaging is atomic for both workers: with learning rate 0 the sum of
all workers' parameters stays constant (up to rounding), and the pair ends
bitwise identical (both compute op(x_lower rank, x_higher rank) / 2, in
float32 for float16/bfloat16). The gradient itself may be computed on a model
that is being averaged (the caller's forward pass reads x_i while a service
thread writes it): that inconsistent read is part of the paper's model. The
average is formed aside and copied in, so the read sees each element either
before or after an averaging, never a partial result.

No deadlock: only active workers wait for another worker, and only for a
passive worker's server, which waits for nobody (it takes only its own
worker's lock, held by that worker's main thread only for an optimizer step).
So there is no cycle of waits, under any timing. A server that fails
(an exception on its thread) aborts the job rather than leave its active
neighbors waiting.

Graph (``topology``): any bipartite topology of :mod:`algorithms.topology`
(a name or a :class:`~algorithms.topology.Topology`); the default is the ring
when n is even (even ranks active) and, for odd n, where a ring is not
bipartite, the complete bipartite graph between even and odd ranks
(:func:`~algorithms.topology.bipartite`). The mixing weights are not used:
every averaging weighs the pair 1/2, 1/2.

Messages, on a private duplicate of the communicator: a request carrying the
active worker's model (m bytes) and the passive worker's reply with its model
(m bytes); an empty message marks the end of a phase (:meth:`ADPSGD.settle`).
A model without parameters or buffers (m = 0) has nothing to average: its
workers step alone, with neither averaging thread nor server.
Each worker sends m bytes per averaging it takes part in. Cost of an
averaging: 2 (alpha + m beta) + m gamma, plus up to a poll interval of the
server (:class:`collectives.transport.p2p.Backoff`, at most 250 us, which leaves the
cores to the computation) — off the active worker's critical path when the
gradient takes longer.

:meth:`ADPSGD.settle` (collective): every active worker waits for its
averaging in flight and sends an end marker to each passive neighbor; every
passive worker waits until its server has received one from each active
neighbor. Then no averaging is in flight, and none starts before the next
step. :meth:`ADPSGD.close` settles, then stops the threads. A settled worker's
state beyond its model and optimizer is its random generator and counters
(:meth:`ADPSGD.state_dict`): a resumed worker draws the neighbors it would
have drawn, though the interleaving of the workers' steps is the new run's.

Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default; refused below it). The
service threads make the model's CUDA device current when they start
(:func:`collectives.transport.gpu.use_device`); an exception in one ends the
job (:mod:`collectives.transport.threads`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import Any
from zlib import crc32

import numpy as np
from mpi4py import MPI

from collectives import ArgumentError, reduction
from collectives.partial.placement import Placement
from collectives.topology.layout import layout as node_layout
from collectives.transport import gpu, p2p, threads
from collectives.transport.background import Background
from collectives.transport.buffers import array_module
from collectives.transport.scratch import scratch

from . import events
from .base import Algorithm
from .topology import Topology, build

#: How an active worker chooses the neighbor of its next averaging.
PARTNERS = ("random", "aware")


class ADPSGD(Algorithm):
    """Asynchronous pairwise averaging over a bipartite graph (module docstring).

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        topology: a bipartite :class:`~algorithms.topology.Topology` on the
            communicator's size or the name of one; None: the ring for even
            n, ``"bipartite"`` for odd n.
        seed: seeds each worker's choice of neighbors (with its rank).
        partner: "random" (the paper's) or "aware" (module docstring).
        cross_every: aware: every how many averagings cross nodes (>= 1).

    Attributes:
        topology: the resolved graph.
        active: whether this worker starts averagings (else it serves them).
        peers: its neighbors, all on the other side.
        averagings: averagings this worker took part in.
        last_peer: the neighbor of the last averaging it started (active), or None.
    """

    name = "adpsgd"
    uneven_steps = True

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        topology: str | Topology | None = None,
        seed: int = 0,
        partner: str = "random",
        cross_every: int = 2,
        **common: Any,
    ) -> None:
        self.topology_arg, self.seed, self.partner, self.cross_every = topology, seed, partner, cross_every
        self.averagings = 0
        self.last_peer: int | None = None
        self._background: Background | None = None
        self._server: _Server | None = None
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        topo = self.topology_arg
        if topo is None:
            topo = build("ring" if self.size % 2 == 0 else "bipartite", self.size)
        elif isinstance(topo, str):
            topo = build(topo, self.size)
        elif not isinstance(topo, Topology):
            raise ArgumentError(
                f"topology must be a name or an algorithms.topology.Topology, got {type(topo).__name__}"
            )
        if topo.size != self.size:
            raise ArgumentError(f"topology {topo.name} has {topo.size} ranks, the communicator {self.size}")
        sides = topo.sides()
        if sides is None:
            raise ArgumentError(
                f"AD-PSGD needs a bipartite graph (active workers averaging only with passive "
                f"ones); {topo.name} is not: use topology='bipartite' (or a ring of even size)"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ArgumentError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.partner not in PARTNERS:
            raise ArgumentError(f"unknown partner choice {self.partner!r}; valid: {', '.join(PARTNERS)}")
        if isinstance(self.cross_every, bool) or not isinstance(self.cross_every, int) or self.cross_every < 1:
            raise ArgumentError(f"cross_every must be an integer >= 1, got {self.cross_every!r}")
        threads.require_multiple("AD-PSGD averages on service threads")
        self.topology, self.active, self.peers = topo, sides[self.rank] == 0, topo.neighbors(self.rank)
        return (topo.name, crc32(topo.W.tobytes()), self.seed, self.partner, self.cross_every)

    def _start(self) -> None:
        self._comm = self.comm.Dup()
        self._lock = threading.Lock()
        self._red = reduction("avg", self.flat.dtype, array_module(self.flat.state_data))
        self._rng = np.random.default_rng([self.seed, self.rank])
        self._placement = (
            Placement(node_layout(self.comm).node_of, self.cross_every) if self.partner == "aware" else None
        )
        if not self.peers or not self.flat.state_data.shape[0]:  # no neighbor, or nothing to average
            return
        if self.active:
            self._background = Background(f"adpsgd-averaging-rank{self.rank}", gpu.device_of(self.flat.state_data))
        else:
            self._server = _Server(self)

    def _step(self) -> None:
        if self._server is not None:  # passive
            t0 = time.perf_counter()
            with self._lock:
                self.comm_wait_s += time.perf_counter() - t0
                self.optimizer.step()
            self._count_served()
            return
        if self._background is not None and self._background.pending:
            self._collect()
        self.optimizer.step()
        if self._background is not None:
            self.last_peer = self._next_peer()
            self._background.submit(self._average_with, self.last_peer, self.iterations)

    def _next_peer(self) -> int:
        """The neighbor of the next averaging: drawn at random, or by place and speed (aware)."""
        if self._placement is None:
            return self.peers[int(self._rng.integers(len(self.peers)))]
        shuffled = [self.peers[i] for i in self._rng.permutation(len(self.peers))]
        chosen = self._placement.choose(self.rank, shuffled, 1)
        return shuffled[0] if chosen is None else chosen[0]  # None: a crossing is due, but no neighbor is away

    def _average_with(self, peer: int, step: int) -> float:
        """On the averaging thread: x_i, x_peer <- (x_i + x_peer) / 2 (the peer's server does its
        half); the seconds it took (a recorded timeline gets it as a span of ``step``)."""
        t0 = time.perf_counter()
        x = self.flat.state_data
        theirs = scratch(x, x.shape[0])
        p2p.operation(f"AD-PSGD averaging with rank {peer}")
        pending = [p2p.irecv(self._comm, theirs, peer), p2p.isend(self._comm, x, peer)]
        p2p.waitall(pending, self._comm, (peer,), poll=True)
        _average(self._red, x, theirs, peer < self.rank)
        t1 = time.perf_counter()
        if events.active is not None:
            events.active.add(f"average with rank {peer}", events.COMMUNICATION, t0, t1, step=step)
        return t1 - t0

    def _collect(self) -> None:
        """Wait for the averaging in flight; count its time and bytes."""
        assert self._background is not None  # active workers only
        with self._communicating("wait for averaging", events.WAIT):
            seconds, nbytes = self._background.result()
        self.bytes_sent += nbytes
        self.averagings += 1
        if self._placement is not None and self.last_peer is not None:
            self._placement.exchanged((self.rank, self.last_peer), seconds)

    def _count_served(self) -> None:
        """Add what the server did since the last count (passive)."""
        assert self._server is not None  # passive workers only
        served, nbytes = self._server.take_counts()
        self.averagings += served
        self.bytes_sent += nbytes

    def settle(self) -> None:
        """Finish every averaging in flight (collective; module docstring)."""
        super().settle()
        if self._background is not None:
            if self._background.pending:
                self._collect()
            end = self.flat.state_data[:0]
            for peer in self.peers:
                p2p.send(self._comm, end, peer)
        elif self._server is not None:
            t0 = time.perf_counter()
            self._server.wait_for_ends(len(self.peers))
            self.comm_wait_s += time.perf_counter() - t0
            self._count_served()

    def state_dict(self) -> dict[str, Any]:
        """The counters, the averagings, the last peer and the neighbor generator's state (after settle())."""
        if self._background is not None and self._background.pending:
            raise RuntimeError("AD-PSGD state_dict() with an averaging in flight: call settle() first")
        return {
            **super().state_dict(),
            "averagings": self.averagings,
            "last_peer": self.last_peer,
            "rng": self._rng.bit_generator.state,
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        super()._load_state(state)
        self.averagings, self.last_peer = int(state["averagings"]), state["last_peer"]
        self._rng.bit_generator.state = state["rng"]

    def close(self) -> None:
        """Settle, stop the threads, free the private communicator (collective)."""
        if self.closed:
            return
        self.settle()
        if self._background is not None:
            self._background.close()
        if self._server is not None:
            self._server.stop()
        self._comm.Free()
        super().close()


def _average(red: Any, x: Any, theirs: Any, theirs_first: bool) -> None:
    """x <- (x + theirs) / 2, the lower rank's operand first (so both ends compute the same bits).

    The average is formed in ``theirs`` and copied into ``x`` in one pass: the
    worker's main thread reads ``x`` meanwhile (its forward pass), and must see
    each element either before or after the averaging, never the sum."""
    red.combine(theirs, x, src_first=not theirs_first)
    red.finalize(theirs, 2)
    array_module(x).copyto(x, theirs)


class _Server:
    """A passive worker's thread: answers averaging requests, counts end markers."""

    def __init__(self, algo: ADPSGD) -> None:
        self.algo = algo
        self._ends = 0
        self._served = self._sent = 0  # since the last take_counts()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threads.start(self._serve, f"adpsgd-server-rank{algo.rank}")

    def _serve(self) -> None:
        algo = self.algo
        comm, x, lock = algo._comm, algo.flat.state_data, algo._lock
        gpu.use_device(gpu.device_of(x))
        theirs = scratch(x, x.shape[0])
        status, backoff = MPI.Status(), p2p.Backoff()
        while not self._stopping:
            if not comm.Iprobe(MPI.ANY_SOURCE, p2p.TAG, status):
                backoff.sleep()
                continue
            backoff.reset()
            peer = status.Get_source()
            if status.Get_count(MPI.BYTE) == 0:
                p2p.recv(comm, x[:0], peer)
                with self._cond:
                    self._ends += 1
                    self._cond.notify_all()
                continue
            p2p.operation(f"AD-PSGD averaging requested by rank {peer}")
            before = p2p.bytes_sent()
            with lock:
                p2p.recv(comm, theirs, peer)
                p2p.send(comm, x, peer)
                _average(algo._red, x, theirs, peer < algo.rank)
            with self._cond:
                self._served += 1
                self._sent += p2p.bytes_sent() - before

    def take_counts(self) -> tuple[int, int]:
        """(averagings served, bytes sent) since the last call."""
        with self._cond:
            counts = (self._served, self._sent)
            self._served = self._sent = 0
        return counts

    def wait_for_ends(self, k: int) -> None:
        """Wait until ``k`` end markers have arrived since the last wait, and consume them."""
        blocked = p2p.watch(self.algo._comm, self.algo.peers)
        p2p.operation("AD-PSGD settle (waiting for the active neighbors' end markers)")
        try:
            with self._cond:
                self._cond.wait_for(lambda: self._ends >= k)
                self._ends -= k
        finally:
            blocked.since = 0.0

    def stop(self) -> None:
        """End the thread (after :meth:`ADPSGD.settle`: no request can come)."""
        self._stopping = True
        self._thread.join()
