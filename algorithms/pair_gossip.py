"""Compressed pairwise gossip: CHOCO-SGD's public copies kept per edge, for AD-PSGD and Prague.

CHOCO-SGD (Koloskova, Stich & Jaggi, "Decentralized Stochastic Optimization
and Gossip Algorithms with Compressed Communication", ICML 2019) lets workers
average through a compressor C without moving their mean: each worker keeps
a public copy x^ of its model that its neighbors rebuild from the same
payloads, sends only C(x - x^), and steps towards its neighbors' copies.
D-PSGD's form (:mod:`algorithms.dpsgd`) sends to every neighbor at every
step, so one copy of each worker serves all its neighbors. AD-PSGD (Lian,
Huang, Li, Zhang & Liu, "Asynchronous Decentralized Parallel Stochastic
Gradient Descent", ICML 2018) averages with one neighbor at a time, and
Prague (Luo, He, Zhuo & Qian, ASPLOS 2020) with a group the group generator
hands out, so what neighbor j knows of x_i differs from what neighbor k
knows: the copies are kept per edge. For the edge (i, j), worker i keeps

* ``mine``: x^_i as j knows it, and ``theirs``: x^_j as i knows it

and worker j the same two, swapped. An exchange between i and j
(:meth:`PairCopies.encode`, then :meth:`PairCopies.mix` on both ends), with
w = 1/2 for a pair:

    q_i = C(s (x_i - x^_i)),  q_j = C(s (x_j - x^_j))  sent to each other
    x^_i += q_i,  x^_j += q_j                           on both ends
    e = gamma w (x^_j - x^_i)
    x_i += e,  x_j -= e                                 (j computes -e)

Both ends decode the same payloads with compressors seeded alike, so their
copies of the edge stay bitwise identical without ever being sent; e is
computed from those copies as x^_j - x^_i on i and x^_i - x^_j on j, which
IEEE arithmetic makes exact negatives of each other, so the pair's sum
x_i + x_j is kept exactly in exact arithmetic and to one rounding of each
addition in floating point. With C the identity, gamma = 1 and copies that
start equal to the models, x_i and x_j become (x_i + x_j) / 2: AD-PSGD's
averaging. s = 1 / (1 + omega) shrinks the unbiased compressors of large
variance to a contraction as CHOCO needs
(:func:`algorithms.compressed.variance_factor`), and gamma is CHOCO's
consensus step (:func:`algorithms.compressed.consensus_step`; ``--gamma``).
No error feedback: x - x^ carries what earlier payloads left out.

A group of k workers (Prague's, :func:`group_exchange`): every member runs
the exchange above on each of its k - 1 edges inside the group at once, with
w = 1/k, every payload encoded from the model before the group. Each edge
keeps its pair's sum, so the group's sum is kept; with C the identity, gamma
= 1 and copies equal to the models, x_i + sum_j (x_j - x_i) / k is the
group's mean, Prague's averaging (k = 2: the pair's above).

Stateful compressors: each edge has its own compressor on each end, seeded
by (seed, the edge's two ``MPI_COMM_WORLD`` ranks), and each end encodes
once per exchange, so random-k draws the same indices on both ends of an
edge at every exchange; PowerSGD's payload carries its factors.

Copies start at the common initial model where every worker starts there
(``broadcast_init``), else at 0 (as in the paper), also those of an edge
made later (Prague keeps the initial model for them); after a worker's death
(AD-PSGD's ``on_failure="continue"``) the survivors' new edges start at 0.

Memory: 2 copies of the model (its state: parameters and float buffers) per
edge, plus one work buffer of the model's size. AD-PSGD makes its neighbors'
edges at the start; Prague makes an edge when it first meets the partner
(any worker may be), so up to 2 (n - 1) copies of the model on each worker
of n, plus one model where a new edge's copies start, and the payloads of a
group (k - 1 sent, k - 1 received). Bytes per exchange: the
compressor's payload (``payload_nbytes`` of the state) to each other member,
against the model each way for a pair uncompressed (a group's ring
all-reduce: 2 m (k - 1) / k); computation: per edge one encoding and two
decodings on each end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from collectives import Compressor
from collectives.transport import p2p
from collectives.transport.scratch import scratch

from .compressed import Layout, compressor_for, host_copy, load_into, require
from .error_feedback import zeros_like

#: Scratch slots of a group exchange's payloads to and from its i-th other member: SENT + i, RECEIVED + i.
SENT, RECEIVED = 0x6700, 0x6780


def edge_seed(seed: int, a: int, b: int) -> int:
    """The seed of both ends' compressors of the edge between world ranks ``a`` and ``b``."""
    return int(np.random.SeedSequence([seed, min(a, b), max(a, b)]).generate_state(1)[0])


class PairCopies:
    """One end's state of one edge: its compressor and the two public copies (module docstring).

    Args:
        spec: the compressor spec (the same on both ends).
        layout: the layout of the state (:func:`algorithms.compressed.compressor_for`).
        seed: :func:`edge_seed` of the edge.
        like: the state buffer; the copies take its kind, length and dtype.
        start: the initial value of both copies (the common initial model), or None: 0.

    Attributes:
        compressor: this end's compressor of the edge.
        mine: this worker's public copy as the neighbor knows it.
        theirs: the neighbor's public copy.
    """

    def __init__(self, spec: str, layout: Layout, seed: int, like: Any, start: Any = None) -> None:
        self.compressor: Compressor = compressor_for(spec, layout, seed)
        self.mine, self.theirs = zeros_like(like), zeros_like(like)
        if start is not None:
            self.mine[...] = start
            self.theirs[...] = start

    def encode(self, x: Any, work: Any, shrink: float) -> Any:
        """The payload of C(shrink (x - mine)), in the compressor's reusable memory; ``work``
        (like ``x``) is overwritten, ``x`` only read."""
        work[...] = x
        work -= self.mine
        if shrink != 1:
            work *= shrink
        return self.compressor.compress(work)

    def mix(self, sent: Any, received: Any, work: Any, weight: float) -> Any:
        """Add the decoded payloads to the copies (``sent`` to ``mine``, ``received`` to
        ``theirs``) and return ``work`` set to the consensus step weight (theirs - mine),
        which the caller adds to its model (weight: gamma w, module docstring)."""
        self.compressor.decompress(sent, self.mine, add=True)
        self.compressor.decompress(received, self.theirs, add=True)
        work[...] = self.theirs
        work -= self.mine
        work *= weight
        return work


def group_exchange(edges: Sequence[PairCopies], group: Any, x: Any, work: Any, gamma: float, shrink: float) -> None:
    """The compressed gossip of a group (module docstring), on one member: ``x`` (its
    model's state) gets the consensus steps of its edges with the other members, and the
    edges' copies their payloads. ``group``: the members as a communicator (ranks 0..k-1,
    e.g. a :class:`~collectives.partial.group_comm.GroupComm`); ``edges``: this member's
    edge with each other member, in the group's rank order; ``work`` (like ``x``) is
    overwritten. Collective over the group; each member sends its k - 1 payloads."""
    me, k = group.Get_rank(), group.Get_size()
    others = tuple(r for r in range(k) if r != me)
    sent, received = [], []
    for i, edge in enumerate(edges):
        payload = edge.encode(x, work, shrink)  # in the compressors' shared memory: kept aside
        sent.append(scratch(payload, payload.shape[0], SENT + i))
        sent[-1][...] = payload
        received.append(scratch(payload, payload.shape[0], RECEIVED + i))
    pending = [p2p.irecv(group, buf, r) for buf, r in zip(received, others)]
    pending += [p2p.isend(group, buf, r) for buf, r in zip(sent, others)]
    p2p.waitall(pending, group, others)
    for edge, mine, theirs in zip(edges, sent, received):
        x += edge.mix(mine, theirs, work, gamma / k)


def save_copies(edges: dict[int, PairCopies], length: int) -> dict[str, Any]:
    """The edges' copies for a checkpoint: ``copy_peers``, the partners in order, and
    ``copies``, (mine, theirs) of each, as rows of one host array of ``length`` columns."""
    peers = sorted(edges)
    copies = [host_copy(c) for p in peers for c in (edges[p].mine, edges[p].theirs)]
    return {"copy_peers": peers, "copies": np.stack(copies) if copies else np.zeros((0, length))}


def load_copies(edges: dict[int, PairCopies], state: dict[str, Any], what: str) -> None:
    """Set the copies of ``edges`` from ``state`` (:func:`save_copies`), which must hold
    those of the same partners.

    Raises:
        ValueError: copies missing (``what`` says why there may be none), of other
            partners, or of another length or dtype.
    """
    require(state, ("copy_peers", "copies"), what)
    peers, copies = sorted(edges), state["copies"]
    if list(state["copy_peers"]) != peers or len(copies) != 2 * len(peers):
        raise ValueError(f"the copies are of the edges with {state['copy_peers']}, not {peers}")
    for k, peer in enumerate(peers):
        load_into(edges[peer].mine, copies[2 * k], f"the copy of the edge with {peer}")
        load_into(edges[peer].theirs, copies[2 * k + 1], f"the copy of the edge with {peer}")
