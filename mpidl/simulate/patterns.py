"""The communication patterns of the all-reduces, as phases of flows for the network model.

A pattern is a list of (phase, repeat): a phase is the transfers that run at
once (:data:`~mpidl.simulate.network.Phase`), and the next phase starts when
all of them have ended. The phases are those of mpidl's kernels:

* :func:`ring` (:mod:`collectives.kernels.ring`): over k members, a
  reduce-scatter of k - 1 steps and an all-gather of k - 1 steps; in each,
  every member sends one m/k-byte chunk to the next. On one worker per node
  at rate B and latency alpha: 2(k-1)(alpha + m/(kB)).
* :func:`hierarchical_ring` (:mod:`collectives.kernels.hierarchical_ring`):
  a binomial reduce to each node's leader (its lowest worker) of ceil(lg q)
  steps of m bytes, a ring among the leaders, a binomial broadcast back.

Each step of a ring is a barrier here, where the kernel lets a member go on
as soon as its own chunk has arrived; the two agree when the members' links
are alike, as in an all-reduce that all workers enter together.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .network import Phase

#: A pattern: its phases with their repeat counts.
Pattern = list[tuple[Phase, int]]


def ring(members: Sequence[int], nbytes: float) -> Pattern:
    """The ring all-reduce of ``nbytes`` among ``members`` (in ring order)."""
    k = len(members)
    if k < 2:
        return []
    step = tuple((members[i], members[(i + 1) % k], nbytes / k) for i in range(k))
    return [(step, 2 * (k - 1))]


def binomial_reduce(members: Sequence[int], nbytes: float) -> Pattern:
    """Reduce ``nbytes`` to ``members[0]`` by a binomial tree (ceil(lg q) steps)."""
    out: Pattern = []
    mask = 1
    while mask < len(members):
        out.append((tuple((members[i], members[i - mask], nbytes) for i in range(mask, len(members), 2 * mask)), 1))
        mask <<= 1
    return out


def hierarchical_ring(node_of: Sequence[int], nbytes: float) -> Pattern:
    """The hierarchical ring all-reduce of ``nbytes`` over every worker (``node_of``: each
    worker's node): the nodes' reduces at once, the leaders' ring, the nodes' broadcasts."""
    by_node: dict[int, list[int]] = {}
    for w, k in enumerate(node_of):
        by_node.setdefault(k, []).append(w)
    nodes = [by_node[k] for k in sorted(by_node)]
    reduce = [binomial_reduce(members, nbytes) for members in nodes]
    depth = max(len(r) for r in reduce)
    merged = [tuple(f for r in reduce if s < len(r) for f in r[s][0]) for s in range(depth)]
    out: Pattern = [(phase, 1) for phase in merged]
    out += ring([members[0] for members in nodes], nbytes)
    out += [(tuple((dst, src, b) for src, dst, b in phase), 1) for phase in reversed(merged)]
    return out


#: The all-reduce patterns by the name of mpidl's kernel: (workers' nodes, bytes) -> pattern.
ALLREDUCES = {
    "ring": lambda node_of, nbytes: ring(range(len(node_of)), nbytes),
    "hierarchical_ring": hierarchical_ring,
}


def sent_by(pattern: Pattern, node_of: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(bytes each worker sends in ``pattern``, of which to other nodes)."""
    sent, inter = np.zeros(len(node_of)), np.zeros(len(node_of))
    for phase, repeat in pattern:
        for src, dst, nbytes in phase:
            sent[src] += repeat * nbytes
            if node_of[src] != node_of[dst]:
                inter[src] += repeat * nbytes
    return sent, inter


__all__ = ["ALLREDUCES", "Pattern", "binomial_reduce", "hierarchical_ring", "ring", "sent_by"]
