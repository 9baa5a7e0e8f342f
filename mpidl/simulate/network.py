"""The simulated cluster's network: a flow-level model with max-min fair sharing.

Links: every node has a NIC with an up and a down direction of ``inter``
bytes/s each, and an intra-node fabric of ``intra`` bytes/s (shared memory)
that all transfers inside the node share. A transfer from worker s to worker
d of m bytes is a *flow*: after the latency alpha of its link class
(``alpha_inter`` across nodes, ``alpha_intra`` inside one) its bytes flow at
a rate that the model gives it, until the last byte is delivered. Across
nodes a flow uses s's node's up link and d's node's down link; inside a node
it uses the node's fabric only.

Sharing: whenever a flow starts or ends, the rates of all flows in flight are
recomputed max-min fairly over the links (progressive filling: the link whose
capacity divided by its unfrozen flows is least fixes those flows at that
share; repeat with the capacity left), the fluid model of TCP's steady state
that flow-level simulators use (e.g. SimGrid's LV08 without its TCP-window
bound; Velho & Legrand, "Accuracy Study and Improvement of Network Simulation
in the SimGrid Framework", SIMUTools 2009). So a lone flow takes
alpha + m / B, two flows out of one NIC each get B/2, and a ring all-reduce
over n nodes (one worker each) takes 2(n-1)(alpha + m/(nB))
(:mod:`~mpidl.simulate.patterns`). Not modelled: TCP's slow start and
congestion window, packet loss, the CPU time of the transport.

Calibration (:meth:`Links.calibrated`): the NIC rate is the cluster's link
rate as given (``--rate``, as ``tc`` writes it); the latencies and the
intra-node rate are the alpha-beta cost model's
(:class:`collectives.tuning.costmodel.Params`: its built-in defaults, or a
calibration file that ``mpidl bench --calibrate`` wrote, measured on the
machine being modelled).

Cost: O(F + L) numpy work per flow start or end and per round of the
progressive filling (a few rounds where links are alike), F flows in flight,
L links.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from collectives.tuning.costmodel import Params

from .engine import Engine

#: A transfer of a phase: (source worker, destination worker, bytes).
Flow = tuple[int, int, float]
#: Flows that start together; the phase ends when the last of them does.
Phase = tuple[Flow, ...]

_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)\s*")
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """Bytes per second of a link rate written as ``tc`` writes it: "1gbit", "100mbit",
    "10gbit" (bits per second), or "125mbps" (bytes per second).

    Raises:
        ValueError: not such a rate, or not positive.
    """
    match = _RATE.fullmatch(text.lower())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"expected a positive link rate such as 1gbit, 100mbit or 125mbps, got {text!r}")
    value = float(match.group(1)) * _SCALE[match.group(2)]
    return value / 8 if match.group(3) == "bit" else value


@dataclass(frozen=True)
class Links:
    """The links' rates in bytes/s and latencies in seconds (module docstring)."""

    inter: float
    intra: float
    alpha_inter: float
    alpha_intra: float

    def __post_init__(self) -> None:
        if not (self.inter > 0 and self.intra > 0 and self.alpha_inter >= 0 and self.alpha_intra >= 0):
            raise ValueError(f"link rates must be positive and latencies not negative: {self}")

    @classmethod
    def calibrated(cls, rate: float, params: Params | None = None) -> Links:
        """NICs of ``rate`` bytes/s; latencies and the intra-node rate of the cost model's
        ``params`` (default: its built-in defaults)."""
        p = Params() if params is None else params
        return cls(rate, 1.0 / p.beta_intra, p.alpha_inter, p.alpha_intra)


#: A flow is over when fewer bytes than this are left (rounding of rate x time).
_EPSILON_BYTES = 1e-6


class Network:
    """Flows between the workers of a cluster whose worker w is on node ``node_of[w]``.

    Args:
        engine: the event engine whose clock the flows follow.
        node_of: each worker's node, 0..N-1.
        links: the links (:class:`Links`).

    Attributes:
        sent: bytes each worker sent so far.
        sent_inter: bytes each worker sent to other nodes so far.
    """

    def __init__(self, engine: Engine, node_of: Sequence[int], links: Links) -> None:
        self.engine, self.links = engine, links
        self.node_of = tuple(int(k) for k in node_of)
        if not self.node_of or min(self.node_of) < 0:
            raise ValueError("node_of must name a node 0, 1, ... for every worker")
        self.nodes = max(self.node_of) + 1
        n = self.nodes
        # Links: up[k] = k, down[k] = n + k, fabric[k] = 2n + k, and one unlimited (3n) for
        # the second link of a flow that uses one.
        self._capacity = np.array([links.inter] * (2 * n) + [links.intra] * n + [np.inf])
        self._links = np.zeros((0, 2), np.int64)
        self._left = np.zeros(0)
        self._rates = np.zeros(0)
        self._done: list[Callable[[], None]] = []
        self._updated = 0.0
        self._version = 0
        self._alone: dict[Phase, float] = {}
        self.sent = np.zeros(len(self.node_of))
        self.sent_inter = np.zeros(len(self.node_of))

    def _route(self, src: int, dst: int) -> tuple[int, int]:
        a, b = self.node_of[src], self.node_of[dst]
        return (2 * self.nodes + a, 3 * self.nodes) if a == b else (a, self.nodes + b)

    def latency(self, src: int, dst: int) -> float:
        """The latency alpha of a message from ``src`` to ``dst``."""
        same = self.node_of[src] == self.node_of[dst]
        return self.links.alpha_intra if same else self.links.alpha_inter

    @property
    def in_flight(self) -> int:
        """Flows whose bytes are flowing now."""
        return len(self._done)

    def transfer(self, src: int, dst: int, nbytes: float, done: Callable[[], None]) -> None:
        """Send ``nbytes`` from worker ``src`` to worker ``dst``; call ``done()`` when the
        last byte has arrived (module docstring).

        Raises:
            ValueError: ``src`` is ``dst``, or ``nbytes`` is negative.
        """
        if src == dst or nbytes < 0:
            raise ValueError(f"a transfer needs two workers and bytes >= 0, got {src} -> {dst} of {nbytes}")
        self.sent[src] += nbytes
        if self.node_of[src] != self.node_of[dst]:
            self.sent_inter[src] += nbytes
        self.engine.after(self.latency(src, dst), self._begin, self._route(src, dst), float(nbytes), done)

    def _begin(self, route: tuple[int, int], nbytes: float, done: Callable[[], None]) -> None:
        if nbytes <= _EPSILON_BYTES:
            done()
            return
        self._advance()
        self._links = np.vstack((self._links, np.array(route, np.int64)[None]))
        self._left = np.append(self._left, nbytes)
        self._done.append(done)
        self._reshare()

    def _advance(self) -> None:
        """Bring the bytes left of every flow up to now."""
        dt = self.engine.now - self._updated
        if dt > 0 and self._left.size:
            self._left -= self._rates * dt
        self._updated = self.engine.now

    def _reshare(self) -> None:
        """Max-min fair rates for the flows in flight; schedule the next end."""
        self._rates = max_min_rates(self._capacity, self._links)
        self._version += 1
        if self._left.size:
            self.engine.after(float(np.min(self._left / self._rates)), self._end, self._version)

    def _end(self, version: int) -> None:
        if version != self._version:  # the rates changed since: a later event stands for this one
            return
        self._advance()
        over = self._left <= _EPSILON_BYTES + self._rates * 1e-12
        finished = [d for d, o in zip(self._done, over) if o]
        keep = ~over
        self._links, self._left = self._links[keep], self._left[keep]
        self._done = [d for d, o in zip(self._done, over) if not o]
        self._reshare()
        for done in finished:
            done()

    def run_phases(self, phases: Sequence[tuple[Phase, int]], done: Callable[[], None]) -> None:
        """Run ``phases`` (each phase with its repeat count) one after the other, the next
        starting when every flow of the previous one has ended, then call ``done()``."""
        steps = [phase for phase, repeat in phases for _ in range(repeat) if phase]
        self._next_phase(steps, 0, done)

    def _next_phase(self, steps: list[Phase], k: int, done: Callable[[], None]) -> None:
        if k == len(steps):
            done()
            return
        left = [len(steps[k])]

        def ended() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._next_phase(steps, k + 1, done)

        for src, dst, nbytes in steps[k]:
            self.transfer(src, dst, nbytes, ended)

    def alone(self, phases: Sequence[tuple[Phase, int]]) -> float:
        """Seconds that :meth:`run_phases` takes on this cluster when nothing else is on
        the network (each distinct phase simulated once, then remembered)."""
        total = 0.0
        for phase, repeat in phases:
            if not phase or not repeat:
                continue
            if phase not in self._alone:
                engine = Engine()
                net = Network(engine, self.node_of, self.links)
                net.run_phases([(phase, 1)], lambda: None)
                engine.run()
                self._alone[phase] = engine.now
            total += repeat * self._alone[phase]
        return total


def max_min_rates(capacity: np.ndarray, links: np.ndarray) -> np.ndarray:
    """The max-min fair rate of each flow; ``links[f]`` are the two links flow f uses
    (indices into ``capacity``; an unlimited one for a flow that uses one)."""
    flows = links.shape[0]
    rates = np.zeros(flows)
    if not flows:
        return rates
    left = capacity.astype(np.float64).copy()
    frozen = np.zeros(flows, bool)
    size = capacity.size
    while not frozen.all():
        free = links[~frozen]
        count = np.bincount(free.ravel(), minlength=size)
        share = np.full(size, np.inf)
        used = count > 0
        share[used] = left[used] / count[used]
        level = share.min()
        bottleneck = share <= level * (1 + 1e-12)
        hit = ~frozen & bottleneck[links].any(axis=1)
        rates[hit] = level
        np.subtract.at(left, links[hit].ravel(), level)
        frozen |= hit
    return rates


__all__ = ["Flow", "Links", "Network", "Phase", "max_min_rates", "parse_rate"]
