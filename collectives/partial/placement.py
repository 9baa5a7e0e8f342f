"""Partners by place and measured speed: whom a worker averages with next.

Pure bookkeeping, no MPI: the group generator's ``aware`` policy
(:mod:`collectives.partial.group_generator`) and AD-PSGD's ``partner="aware"``
ask it for a worker's partners among the candidates they have, and tell it
what each exchange cost. Workers sit on nodes (``node_of``); an exchange
inside a node goes through shared memory, one across nodes over links, which
may be slow, shared, or one of them slower than the rest.

Rules, for a worker w choosing k partners among candidates:

1. **Inside the node first.** Candidates on w's node come first, oldest first
   (the order given).
2. **Across regularly.** Every ``cross_every``-th exchange of w crosses
   nodes (w's first partner is then on another node), so that every worker's
   model mixes with other nodes' at a bounded interval; a worker alone on its
   node always crosses.
3. **Cheap links first.** When crossing, w takes a candidate of the node to
   which its node's exchanges cost least so far (:meth:`Placement.exchanged`
   keeps an exponential average per pair of nodes; a pair not measured yet
   costs what the slower of its two nodes' links does, each link estimated
   by its node's cheapest pair, and as the cheapest pair where that is
   unknown too); except that every ``explore_every``-th crossing of w goes to the node w
   crossed to least recently, in turn, so that the graph of exchanges over
   time connects every node with every other, slow links included.
4. **Waiting for a partner inside the node** (the group generator only,
   :meth:`Placement.worth_waiting`): with no candidate on w's node and no
   crossing due, w waits for a node mate that is computing if it is expected
   to ask (its last request plus its measured step) sooner than a crossing
   would cost more than an exchange inside the node, and only as long as w has
   not yet waited that long; else it crosses now.

Guarantees (with the group generator's own): no worker in two groups at once
(the generator's locks); every node mixes with every other through some
path (rule 3's turns); the sum of the models is kept (every exchange is an
average). What is measured: seconds per exchange, inside each node and
across; unknown costs count as equal, so before anything is measured rules 1
and 2 alone decide.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Weight of a new measurement in the running averages.
SMOOTHING = 0.2


class Placement:
    """The state behind the rules of the module docstring, for workers on ``node_of``.

    Args:
        node_of: the node of each worker (0..n-1).
        cross_every: every how many exchanges a worker crosses nodes (>= 1; 1:
            always).
        explore_every: every how many crossings of a worker one goes to the
            node it crossed to least recently (>= 1).
    """

    def __init__(self, node_of: Sequence[int], cross_every: int = 2, explore_every: int = 4) -> None:
        if cross_every < 1 or explore_every < 1:
            raise ValueError(f"cross_every and explore_every must be >= 1, got {cross_every}, {explore_every}")
        self.node_of = tuple(int(v) for v in node_of)
        self.nodes = sorted(set(self.node_of))
        self.cross_every, self.explore_every = cross_every, explore_every
        self._mates = {v: sum(1 for u in self.node_of if u == v) for v in self.nodes}
        n = len(self.node_of)
        self._since_cross = [0] * n  # exchanges since the worker last crossed nodes
        self._crossings = [0] * n
        self._visited: list[dict[int, int]] = [{} for _ in range(n)]  # node -> the crossing that went there
        self.pair_cost: dict[tuple[int, int], float] = {}  # (node, node), ascending -> seconds of an exchange
        self.inside_cost: dict[int, float] = {}  # node -> seconds of an exchange inside it

    def due(self, worker: int) -> bool:
        """Whether ``worker``'s next exchange must cross nodes (rule 2)."""
        alone = self._mates[self.node_of[worker]] == 1
        return len(self.nodes) > 1 and (alone or self._since_cross[worker] + 1 >= self.cross_every)

    def choose(self, worker: int, candidates: Sequence[int], k: int) -> list[int] | None:
        """``k`` partners for ``worker`` among ``candidates`` (oldest first), by the rules;
        None where the rules need a candidate that is not there (a crossing is due and
        no candidate is on another node, or fewer than ``k`` candidates)."""
        home = self.node_of[worker]
        same = [c for c in candidates if self.node_of[c] == home]
        away = [c for c in candidates if self.node_of[c] != home]
        if len(candidates) < k:
            return None
        if not self.due(worker) or k == 0:
            return (same + self._by_cost(worker, away))[:k]
        if not away:
            return None
        first = self._crossing_partner(worker, away)
        rest = [c for c in same + self._by_cost(worker, away) if c != first]
        return [first, *rest[: k - 1]]

    def cost_between(self, a: int, b: int) -> float | None:
        """Seconds of an exchange between nodes ``a`` and ``b`` (rule 3), None if nothing is measured."""
        pair = self.pair_cost.get((min(a, b), max(a, b)))
        if pair is not None or not self.pair_cost:
            return pair
        cheapest = min(self.pair_cost.values())
        links = [min((c for p, c in self.pair_cost.items() if v in p), default=cheapest) for v in (a, b)]
        return max(links)

    def crossing_cost(self, worker: int) -> float:
        """How much more ``worker``'s cheapest crossing costs than an exchange inside its
        node (seconds; 0 while either is unmeasured)."""
        home = self.node_of[worker]
        inside = self.inside_cost.get(home)
        costs = [c for v in self.nodes if v != home and (c := self.cost_between(home, v)) is not None]
        if inside is None or not costs:
            return 0.0
        return max(0.0, min(costs) - inside)

    def worth_waiting(self, worker: int, waited: float, mate_expected_in: float | None) -> bool:
        """Whether ``worker``, with no candidate on its node and no crossing due, should
        wait for a node mate expected to ask in ``mate_expected_in`` seconds (None:
        unknown), having waited ``waited`` seconds already (rule 4)."""
        if self.due(worker) or mate_expected_in is None:
            return False
        patience = self.crossing_cost(worker)
        return waited < patience and mate_expected_in < patience

    def exchanged(self, members: Sequence[int], seconds: float | None = None) -> None:
        """``members`` exchanged (one group, or an AD-PSGD pair), taking ``seconds``
        from its start to its end where known: count it for each member, and measure."""
        nodes = {self.node_of[m] for m in members}
        crossed = len(nodes) > 1
        for m in members:
            if crossed:
                self._since_cross[m] = 0
                self._crossings[m] += 1
                for v in nodes - {self.node_of[m]}:
                    self._visited[m][v] = self._crossings[m]
            else:
                self._since_cross[m] += 1
        if seconds is not None:
            keys = [(a, b) for a in nodes for b in nodes if a < b]
            costs: dict = self.pair_cost if crossed else self.inside_cost
            for key in keys if crossed else list(nodes):
                old = costs.get(key)
                costs[key] = seconds if old is None else (1 - SMOOTHING) * old + SMOOTHING * seconds

    def _by_cost(self, worker: int, away: list[int]) -> list[int]:
        """``away`` ordered by what an exchange with their node costs ``worker``'s (unmeasured:
        nothing), then in the given order."""
        home = self.node_of[worker]
        return sorted(away, key=lambda c: self.cost_between(home, self.node_of[c]) or 0.0)

    def _crossing_partner(self, worker: int, away: list[int]) -> int:
        """The first partner of a crossing (rule 3)."""
        if (self._crossings[worker] + 1) % self.explore_every == 0:
            visited = self._visited[worker]
            return min(away, key=lambda c: visited.get(self.node_of[c], -1))  # least recently, never first
        return self._by_cost(worker, away)[0]
