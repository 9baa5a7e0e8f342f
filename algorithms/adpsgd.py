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

Compressed gossip (``compression="NAME[:PARAM]"``, ``gamma``): the pair
exchanges compressed differences to public copies kept per edge instead of
models (CHOCO-SGD's copies, :mod:`algorithms.pair_gossip`): a request
carries the active worker's payload C(x_i - x^_i), the reply the passive
worker's, P bytes each (the compressor's ``payload_nbytes`` of the state,
against m), and both step by gamma / 2 towards the other's copy, so the
pair's sum is kept. Atomic as the averaging: a passive worker's server holds
the lock from receiving the payload to writing its step (encoding, reply,
both copies of the edge updated), and an active worker's copies and model
are written only by its averaging thread; its model gets the step in one
pass (x += e), so a concurrent read sees each element before or after it.
Memory: two copies of the state per neighbor and one work buffer.

:meth:`ADPSGD.settle` (collective): every active worker waits for its
averaging in flight and sends an end marker to each passive neighbor; every
passive worker waits until its server has received one from each active
neighbor. Then no averaging is in flight, and none starts before the next
step. :meth:`ADPSGD.close` settles, then stops the threads. A settled worker's
state beyond its model and optimizer is its random generator and counters
(:meth:`ADPSGD.state_dict`): a resumed worker draws the neighbors it would
have drawn, though the interleaving of the workers' steps is the new run's.

A worker that dies (``on_failure="continue"``, where the MPI library has
ULFM, :mod:`collectives.transport.faults`; elsewhere, and by default, it ends
the job): the worker that sees an operation with it fail revokes the private
communicator, so that every survivor's threads see it within a step; each
survivor then recovers in its next :meth:`ADPSGD.step`, :meth:`ADPSGD.settle`
or :meth:`ADPSGD.close` (collective over the survivors, which wait for each
other there): its threads stop, the survivors agree and shrink the
communicator, settle the averagings that the failure interrupted, and go on
over the default graph of the survivors (the ring for an even number, else
the complete bipartite graph; a worker may change sides, and a passive
worker whose active neighbors died gets new ones). :attr:`ADPSGD.comm` is
then the survivors' communicator and :attr:`ADPSGD.lost` names the dead.
An averaging is applied by both of its workers or by neither: an active
worker applies it when it has received its partner's model, a passive worker
when its reply went out; after a failure the passive worker of every pair of
survivors takes back its half (or applies it) where the active worker's view
differs (it keeps the difference its last averaging with each active
neighbor made: m bytes each), so with learning rate 0 the survivors' sum is
what they held, whatever the moment of the failure. With the dead worker,
each survivor's own view stands: an averaging whose transfers failed left it
untouched, one that completed stays. :meth:`ADPSGD.settle` ends, in this
mode, with an agreement (one more collective), so that every survivor leaves
it with the same verdict.

Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default; refused below it). The
service threads make the model's CUDA device current when they start
(:func:`collectives.transport.gpu.use_device`); an exception in one ends the
job (:mod:`collectives.transport.threads`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any
from zlib import crc32

import numpy as np
from mpi4py import MPI

from collectives import ArgumentError, as_flat, reduction
from collectives.compression.memory import RECEIVED
from collectives.partial.placement import Placement
from collectives.topology.layout import layout as node_layout
from collectives.transport import faults, gpu, p2p, threads
from collectives.transport.background import Background
from collectives.transport.buffers import array_module
from collectives.transport.scratch import scratch

from . import events
from .base import Algorithm
from .compressed import Gossip, gossip
from .error_feedback import zeros_like
from .pair_gossip import PairCopies, edge_seed, load_copies, save_copies
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
        on_failure: "abort" (a worker's death ends the job) or "continue" (the
            survivors go on, where the MPI library has ULFM; elsewhere a warning
            says that it has not, and a death ends the job; module docstring).
        compression: None (or "none"): whole models are exchanged; a compressor spec
            "NAME[:PARAM]" of :data:`collectives.COMPRESSORS`: compressed gossip with
            CHOCO-SGD's public copies kept per edge (:mod:`algorithms.pair_gossip`).
        gamma: the compressed gossip's consensus step size in (0, 1] (None: the
            compressor's, :func:`algorithms.compressed.consensus_step`).

    Attributes:
        topology: the resolved graph.
        active: whether this worker starts averagings (else it serves them).
        peers: its neighbors, all on the other side.
        averagings: averagings this worker took part in.
        last_peer: the neighbor of the last averaging it started (active), or None.
        lost: the ``MPI_COMM_WORLD`` ranks of the workers that died (on_failure="continue").
        survives: whether a worker's death leaves the others training (on_failure="continue"
            and ULFM available).
        compressor: the compressed gossip's compressor (its spec; each edge has its own), or None.
        gamma: the compressed gossip's consensus step size, or None.
        edges: compressed gossip: per neighbor, this end's copies of the edge
            (:class:`~algorithms.pair_gossip.PairCopies`); else empty.
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
        on_failure: str = "abort",
        compression: str | None = None,
        gamma: float | None = None,
        **common: Any,
    ) -> None:
        self.topology_arg, self.seed, self.partner, self.cross_every = topology, seed, partner, cross_every
        self.on_failure, self.compression_arg, self.gamma_arg = on_failure, compression, gamma
        self._gossip: Gossip | None = None
        self.compressor: Any = None
        self.gamma: float | None = None
        self.edges: dict[int, PairCopies] = {}
        self.survives = False
        self.lost: list[int] = []
        self.averagings = 0
        self.last_peer: int | None = None
        self._exchanges: dict[int, tuple[int, bool]] = {}  # survives, active: per passive (world rank)
        self._background: Background | None = None
        self._server: _Server | None = None
        self._records: dict[int, tuple[int, bool]] = {}  # a stopped server's, until reconciled
        self._deltas: dict[int, Any] = {}
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        topo = self.topology_arg
        if topo is None:
            topo = _default_graph(self.size)
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
        self.survives = faults.survival(self.on_failure, "AD-PSGD", self.rank)
        self._gossip = gossip(self.compression_arg, self.gamma_arg, self.flat, self.seed)
        if self._gossip is not None:
            self.compressor, self.gamma = self._gossip.compressor, self._gossip.gamma
        threads.require_multiple("AD-PSGD averages on service threads")
        self.topology, self.active, self.peers = topo, sides[self.rank] == 0, topo.neighbors(self.rank)
        graph = (topo.name, crc32(topo.W.tobytes()))
        compression = (self.compressor and self.compressor.spec, self.gamma)
        return (*graph, self.seed, self.partner, self.cross_every, self.on_failure, *compression)

    def _start(self) -> None:
        self._comm = faults.returning(self.comm.Dup()) if self.survives else self.comm.Dup()
        self._lock = threading.Lock()
        self._red = reduction("avg", self.flat.dtype, array_module(self.flat.state_data))
        self._rng = np.random.default_rng([self.seed, self.rank])
        if self._gossip is not None:
            self._work = zeros_like(self.flat.state)
        self._start_threads(self.flat.state if self.broadcast_init else None)

    def _start_threads(self, copies: Any = None) -> None:
        """Placement, the edges' copies (compressed gossip; starting at ``copies`` or 0), and
        the averaging thread (active) or the server (passive), on ``self._comm``."""
        self._placement = (
            Placement(node_layout(self.comm).node_of, self.cross_every) if self.partner == "aware" else None
        )
        self._world = p2p.world_ranks(self._comm)
        self._exchanges, self.edges = {}, {}
        if not self.peers or not self.flat.state_data.shape[0]:  # no neighbor, or nothing to average
            return
        if self._gossip is not None:
            spec, layout, me = self._gossip.compressor.spec, self._gossip.layout, self._world[self.rank]
            self.edges = {
                peer: PairCopies(spec, layout, edge_seed(self.seed, me, self._world[peer]), self.flat.state, copies)
                for peer in self.peers
            }
        if self.active:
            self._background = Background(f"adpsgd-averaging-rank{self.rank}", gpu.device_of(self.flat.state_data))
        else:
            self._server = _Server(self)

    def _failing(self, pending: Sequence[Any] = ()) -> AbstractContextManager:
        """Where a worker's death is survived: a block whose failed transfers revoke the
        private communicator and raise :class:`~collectives.transport.faults.PeerFailure`."""
        return faults.revoking(self._comm, pending) if self.survives else nullcontext()

    def _step(self) -> None:
        if self._background is not None and self._background.pending:
            if not self._collect():
                self._recover()
        elif self._server is not None and self._server.failure is not None:
            self._recover()
        if self._server is not None:  # passive
            t0 = time.perf_counter()
            with self._lock:
                self.comm_wait_s += time.perf_counter() - t0
                self.optimizer.step()
            self._count_served()
            return
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
        """On the averaging thread: x_i, x_peer <- (x_i + x_peer) / 2, or the compressed
        gossip's exchange (the peer's server does its half); the seconds it took (a
        recorded timeline gets it as a span of ``step``)."""
        t0 = time.perf_counter()
        p2p.operation(f"AD-PSGD averaging with rank {peer}")
        world = self._world[peer]
        started = self._exchanges.get(world, (0, False))[0] + 1
        self._exchanges[world] = (started, False)
        if self._gossip is None:
            x = self.flat.state_data
            theirs = scratch(x, x.shape[0])
            self._swap(x, theirs, peer)
            _average(self._red, x, theirs, peer < self.rank)
        else:
            edge, (_, _, gamma, shrink) = self.edges[peer], self._gossip
            sent = edge.encode(self.flat.state, self._work, shrink)
            received = scratch(sent, sent.shape[0], RECEIVED)
            self._swap(sent, received, peer)
            self.flat.state += edge.mix(sent, received, self._work, gamma / 2)
        self._exchanges[world] = (started, True)
        t1 = time.perf_counter()
        if events.active is not None:
            events.active.add(f"average with rank {peer}", events.COMMUNICATION, t0, t1, step=step)
        return t1 - t0

    def _swap(self, send: Any, recv: Any, peer: int) -> None:
        """Send ``send`` to ``peer`` and receive ``recv`` from it (the averaging thread)."""
        pending = [p2p.irecv(self._comm, recv, peer), p2p.isend(self._comm, send, peer)]
        with self._failing(pending):
            p2p.waitall(pending, self._comm, (peer,), poll=True)

    def _collect(self) -> bool:
        """Wait for the averaging in flight; count its time and bytes. False: a peer
        failed (it was abandoned, the private communicator revoked)."""
        assert self._background is not None  # active workers only
        with self._communicating("wait for averaging", events.WAIT):
            try:
                seconds, nbytes = self._background.result()
            except faults.PeerFailure:
                return False
        self.bytes_sent += nbytes
        self.averagings += 1
        if self._placement is not None and self.last_peer is not None:
            self._placement.exchanged((self.rank, self.last_peer), seconds)
        return True

    def _count_served(self) -> None:
        """Add what the server did since the last count (passive)."""
        assert self._server is not None  # passive workers only
        served, nbytes = self._server.take_counts()
        self.averagings += served
        self.bytes_sent += nbytes

    def settle(self) -> None:
        """Finish every averaging in flight (collective; module docstring). Where a worker's
        death is survived, the survivors recover and settle again among themselves."""
        super().settle()
        while not self._settle_once():
            self._recover(agreed=True)

    def _settle_once(self) -> bool:
        """One settle over the current communicator; False: a peer failed (the survivors
        agreed so, on every rank)."""
        ended = True
        if self._background is not None:
            if self._background.pending:
                ended = self._collect()
            end = self.flat.state_data[:0]
            try:
                with self._failing():
                    for peer in self.peers if ended else ():
                        p2p.send(self._comm, end, peer)
            except faults.PeerFailure:
                ended = False
        elif self._server is not None:
            t0 = time.perf_counter()
            ended = self._server.wait_for_ends(self.peers)
            self.comm_wait_s += time.perf_counter() - t0
            self._count_served()
        if not self.survives:
            return True
        if not ended:
            faults.revoke(self._comm)
        with p2p.waiting(self._comm):
            return faults.agree(self._comm, ended)

    def _recover(self, agreed: bool = False) -> None:
        """After a peer failed (collective over the survivors; module docstring): stop the
        threads, agree (unless the caller did), shrink, settle the interrupted averagings,
        and start over on the survivors' communicator and graph."""
        old = self._comm
        faults.revoke(old)  # where this worker saw it first on its own thread: the others see it too
        self._stop_threads()
        survivors, lost = faults.recover(old, "AD-PSGD", agreed)
        self._reconcile(survivors)
        old.Free()
        if not lost:  # a false alarm (faults.false_alarm): the same workers, graph and communicator
            self._comm = survivors
            faults.false_alarm("AD-PSGD", self.rank)
            self._start_threads()
            return
        self.lost += lost
        self.comm, self.rank, self.size = survivors, survivors.Get_rank(), survivors.Get_size()
        self._comm = faults.returning(survivors.Dup())
        self.topology = _default_graph(self.size)
        sides = self.topology.sides()
        assert sides is not None  # the default graphs are bipartite
        self.active, self.peers, self.last_peer = sides[self.rank] == 0, self.topology.neighbors(self.rank), None
        if self.rank == 0:
            faults.warn(
                f"AD-PSGD: worker(s) {', '.join(map(str, lost))} of MPI_COMM_WORLD failed; "
                f"{self.size} continue over the graph {self.topology.name}"
            )
        self._start_threads()

    def _stop_threads(self) -> None:
        """Stop the averaging thread or the server (its averaging abandoned, or done)."""
        if self._background is not None:
            while self._background.pending:
                self._collect()
            self._background.close()
            self._background = None
        if self._server is not None:
            self._server.stop()
            self._count_served()
            self._records, self._deltas = self._server.records, self._server.deltas
            self._server = None

    def _reconcile(self, survivors: MPI.Intracomm) -> None:
        """Make both workers of every averaging between survivors apply it or neither
        (collective over ``survivors``). The active worker's view decides: it applied the
        averaging iff it received its partner's model; a passive worker that differs adds
        back or takes back the difference it recorded (module docstring)."""
        me = p2p.world_ranks(survivors)[survivors.Get_rank()]
        with p2p.waiting(survivors):
            views = dict(survivors.allgather((me, self._exchanges)))
        records, deltas = self._records, self._deltas
        self._records, self._deltas = {}, {}
        x = self.flat.state_data
        xp = array_module(x)
        for active, (served, applied) in records.items():
            if active not in views:  # it died: this worker's own view stands
                continue
            started, received = views[active].get(me, (0, False))
            happened = started > served or received
            if happened != applied:
                (xp.add if happened else xp.subtract)(x, deltas[active], out=x)

    def state_dict(self) -> dict[str, Any]:
        """The counters, the averagings, the last peer and the neighbor generator's state (after
        settle()); compressed gossip: ``copies``, the edges' copies (mine, theirs per neighbor, in
        the order of ``copy_peers``). The edges' compressors restart: random-k's draws and
        PowerSGD's warm start begin again alike on both ends."""
        if self._background is not None and self._background.pending:
            raise RuntimeError("AD-PSGD state_dict() with an averaging in flight: call settle() first")
        state = {
            **super().state_dict(),
            "averagings": self.averagings,
            "last_peer": self.last_peer,
            "rng": self._rng.bit_generator.state,
        }
        if self._gossip is not None:
            state.update(save_copies(self.edges, self.flat.state_data.shape[0]))
        return state

    def _load_state(self, state: dict[str, Any]) -> None:
        super()._load_state(state)
        self.averagings, self.last_peer = int(state["averagings"]), state["last_peer"]
        self._rng.bit_generator.state = state["rng"]
        if self._gossip is not None:
            load_copies(self.edges, state, "the compressed gossip's copies; uncompressed AD-PSGD has none")

    def close(self) -> None:
        """Settle, stop the threads, free the private communicator (collective)."""
        if self.closed:
            return
        self.settle()
        self._stop_threads()
        self._comm.Free()
        super().close()


def _default_graph(n: int) -> Topology:
    """The graph of n workers when none is given: the ring for even n, else the complete
    bipartite graph between even and odd ranks (a ring of odd n is not bipartite)."""
    return build("ring" if n % 2 == 0 else "bipartite", n)


def _mean(red: Any, x: Any, theirs: Any, theirs_first: bool) -> None:
    """theirs <- (x + theirs) / 2, the lower rank's operand first (so both ends compute the same bits)."""
    red.combine(theirs, x, src_first=not theirs_first)
    red.finalize(theirs, 2)


def _average(red: Any, x: Any, theirs: Any, theirs_first: bool) -> None:
    """x <- (x + theirs) / 2 (:func:`_mean`).

    The average is formed in ``theirs`` and copied into ``x`` in one pass: the
    worker's main thread reads ``x`` meanwhile (its forward pass), and must see
    each element either before or after the averaging, never the sum."""
    _mean(red, x, theirs, theirs_first)
    array_module(x).copyto(x, theirs)


class _Server:
    """A passive worker's thread: answers averaging requests, counts end markers.

    Where a worker's death is survived, it also keeps, per active neighbor (world
    rank), ``records``: (averagings whose request it received, whether it applied
    the last one) and ``deltas``: the difference the last one made (or would have
    made) to its model; a failure ends the thread with ``failure`` set."""

    def __init__(self, algo: ADPSGD) -> None:
        self.algo = algo
        self._ends: Counter[int] = Counter()  # end markers not yet consumed, per active neighbor
        self._served = self._sent = 0  # since the last take_counts()
        self._cond = threading.Condition()
        self._stopping = False
        self.failure: faults.PeerFailure | None = None
        self.records: dict[int, tuple[int, bool]] = {}
        self.deltas: dict[int, Any] = {}
        self._thread = threads.start(self._serve, f"adpsgd-server-rank{algo.rank}")

    def _serve(self) -> None:
        try:
            with self.algo._failing():
                self._answer()
        except faults.PeerFailure as exc:  # raised only where a death is survived: the worker recovers
            with self._cond:
                self.failure = exc
                self._cond.notify_all()

    def _answer(self) -> None:
        algo = self.algo
        comm, x, lock = algo._comm, algo.flat.state_data, algo._lock
        gpu.use_device(gpu.device_of(x))
        if algo._gossip is None:
            theirs = scratch(x, x.shape[0])
        else:  # the payloads of C(x - x^)
            size = algo._gossip.compressor.payload_nbytes(x.shape[0], algo.flat.dtype)
            theirs = scratch(x, size, RECEIVED, np.uint8)
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
                    self._ends[peer] += 1
                    self._cond.notify_all()
                continue
            p2p.operation(f"AD-PSGD averaging requested by rank {peer}")
            before = p2p.bytes_sent()
            with lock:
                p2p.recv(comm, theirs, peer)
                if algo._gossip is not None:
                    self._gossip_with(theirs, peer)
                elif algo.survives:
                    self._reply_recorded(x, theirs, peer)
                else:
                    p2p.send(comm, x, peer)
                    _average(algo._red, x, theirs, peer < algo.rank)
            with self._cond:
                self._served += 1
                self._sent += p2p.bytes_sent() - before

    def _reply_recorded(self, x: Any, theirs: Any, peer: int) -> None:
        """Send ``x`` to ``peer`` and average with ``theirs``, its model, where the reply
        went out; record the averaging and the difference it makes (class docstring).
        Raises the reply's MPI error, if any, with ``x`` untouched."""
        algo = self.algo
        failure: MPI.Exception | None = None
        try:
            p2p.send(algo._comm, x, peer)
        except MPI.Exception as exc:
            failure = exc
        _mean(algo._red, x, theirs, peer < algo.rank)
        xp = array_module(x)
        xp.subtract(theirs, x, out=self._record(algo._world[peer], x, failure is None))
        if failure is not None:
            raise failure
        xp.copyto(x, theirs)

    def _gossip_with(self, received: Any, peer: int) -> None:
        """The compressed gossip's exchange with ``peer``, whose payload is ``received``:
        reply with this worker's payload, update the edge's copies, and step towards the
        peer's copy where the reply went out (recorded as :meth:`_reply_recorded` records)."""
        algo = self.algo
        assert algo._gossip is not None
        edge, (_, _, gamma, shrink) = algo.edges[peer], algo._gossip
        sent = edge.encode(algo.flat.state, algo._work, shrink)
        failure: MPI.Exception | None = None
        try:
            p2p.send(algo._comm, sent, peer)
        except MPI.Exception as exc:
            if not algo.survives:
                raise
            failure = exc
        change = edge.mix(sent, received, algo._work, gamma / 2)
        if algo.survives:
            change_data = as_flat(change).data
            self._record(algo._world[peer], change_data, failure is None)[...] = change_data
        if failure is not None:
            raise failure
        algo.flat.state += change

    def _record(self, world: int, like: Any, applied: bool) -> Any:
        """Count an averaging requested by the active worker of world rank ``world``, and
        whether it was ``applied``; return the buffer (like ``like``) that keeps the change
        it makes (or would make) to the model, for the caller to fill."""
        delta = self.deltas.get(world)
        if delta is None:
            delta = self.deltas[world] = array_module(like).empty_like(like)
        self.records[world] = (self.records.get(world, (0, False))[0] + 1, applied)
        return delta

    def take_counts(self) -> tuple[int, int]:
        """(averagings served, bytes sent) since the last call."""
        with self._cond:
            counts = (self._served, self._sent)
            self._served = self._sent = 0
        return counts

    def wait_for_ends(self, peers: Sequence[int]) -> bool:
        """Wait until an end marker has arrived from each of ``peers`` (the active neighbors)
        since the last wait, and consume one of each; False where the thread failed first
        (:attr:`failure`). Markers are counted per neighbor: one that settles twice with no
        collective between (its second marker queued early) must not stand in for another
        whose last averaging is still queued."""
        blocked = p2p.watch(self.algo._comm, self.algo.peers)
        p2p.operation("AD-PSGD settle (waiting for the active neighbors' end markers)")
        try:
            with self._cond:
                self._cond.wait_for(lambda: all(self._ends[p] for p in peers) or self.failure is not None)
                if self.failure is not None:
                    return False
                self._ends.subtract(peers)
                return True
        finally:
            blocked.since = 0.0

    def stop(self) -> None:
        """End the thread (after :meth:`ADPSGD.settle`, or a failure: no request can come)."""
        self._stopping = True
        self._thread.join()
