"""Compressed pairwise gossip: CHOCO-SGD's public copies kept per edge, for AD-PSGD.

CHOCO-SGD (Koloskova, Stich & Jaggi, "Decentralized Stochastic Optimization
and Gossip Algorithms with Compressed Communication", ICML 2019) lets workers
average through a compressor C without moving their mean: each worker keeps
a public copy x^ of its model that its neighbors rebuild from the same
payloads, sends only C(x - x^), and steps towards its neighbors' copies.
D-PSGD's form (:mod:`algorithms.dpsgd`) sends to every neighbor at every
step, so one copy of each worker serves all its neighbors. AD-PSGD (Lian,
Huang, Li, Zhang & Liu, "Asynchronous Decentralized Parallel Stochastic
Gradient Descent", ICML 2018) averages with one neighbor at a time, so what
neighbor j knows of x_i differs from what neighbor k knows: the copies are
kept per edge. For the edge (i, j), worker i keeps

* ``mine``: x^_i as j knows it, and ``theirs``: x^_j as i knows it

and worker j the same two, swapped. An exchange between i and j
(:meth:`PairCopies.encode`, then :meth:`PairCopies.mix` on both ends):

    q_i = C(s (x_i - x^_i)),  q_j = C(s (x_j - x^_j))  sent to each other
    x^_i += q_i,  x^_j += q_j                           on both ends
    e = gamma / 2 (x^_j - x^_i)
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

Stateful compressors: each edge has its own compressor on each end, seeded
by (seed, the edge's two ``MPI_COMM_WORLD`` ranks), and each end encodes
once per exchange, so random-k draws the same indices on both ends of an
edge at every exchange; PowerSGD's payload carries its factors.

Copies start at the common initial model where every worker starts there
(``broadcast_init``), else at 0 (as in the paper); after a worker's death
(``on_failure="continue"``) the survivors' new edges start at 0.

Memory: 2 copies of the model (its state: parameters and float buffers) per
neighbor, plus one work buffer of the model's size. Bytes per exchange: the
compressor's payload (``payload_nbytes`` of the state) each way, against
the model each way uncompressed; computation: two encodings and four
decodings per exchange (each end encodes its own and decodes both).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives import Compressor

from .compressed import Layout, compressor_for
from .error_feedback import zeros_like


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

    def mix(self, sent: Any, received: Any, work: Any, gamma: float) -> Any:
        """Add the decoded payloads to the copies (``sent`` to ``mine``, ``received`` to
        ``theirs``) and return ``work`` set to the consensus step gamma / 2 (theirs - mine),
        which the caller adds to its model."""
        self.compressor.decompress(sent, self.mine, add=True)
        self.compressor.decompress(received, self.theirs, add=True)
        work[...] = self.theirs
        work -= self.mine
        work *= gamma / 2
        return work
