"""Prague simulated: local steps, then P-Reduce with a group that the real group generator hands out.

The schedule of :mod:`algorithms.prague` and :mod:`collectives.partial.preduce`
(Luo et al., ASPLOS 2020), each worker stepping at its own speed:

1. a worker computes its gradient (f_i C) and applies its SGD step; every
   ``local_steps``-th step it sends REQUEST to the group generator, which runs
   on worker 0 (the message takes the latency from it to worker 0);
2. the group generator is :class:`collectives.partial.group_generator.GroupGenerator`
   itself, with the engine's virtual clock as its ``clock``: its policies
   (``random``, ``smart``, ``aware``) form and start the groups as in a real
   run; every member of a started group gets NOTIFY after the latency;
3. a worker in ``average()`` takes its notifications in order; a group's
   ring all-reduce (:func:`~mpidl.simulate.patterns.ring` over its members,
   its flows sharing the links with all other transfers) starts when every
   member has taken its notification, so a member still computing (drafted
   by the ``random`` policy) holds the others up; then every member holds the
   group's average (bitwise alike) and sends DONE; the worker returns from
   ``average()`` after the group that serves its request;
4. the ``aware`` policy's patience is looked at, as the real service does
   while no message comes, every 250 us of virtual time
   (:class:`collectives.transport.p2p.Backoff`'s longest poll).

Epochs: n x S steps of all workers together (:mod:`mpidl.pacing`); a worker
stops at its first step boundary after the budget is spent and pauses
(``settle()``: the group generator's ``close``, serving drafts until every
worker has paused and no group runs, then ``reopen``). With learning rate 0
every group's average keeps the sum of all models. ``static`` groups are not
simulated.
"""

from __future__ import annotations

from collections import deque

from collectives.partial.group_generator import Group, GroupGenerator
from collectives.transport.p2p import Backoff

from .network import Network
from .patterns import ring
from .workers import Workers

#: The simulated policies (``static`` needs no group generator and is not simulated).
POLICIES = ("smart", "aware", "random")
#: Where the group generator runs.
SERVICE = 0


class Prague:
    """Local SGD steps and P-Reduce in generated groups (module docstring).

    Args:
        workers: the workers' numerics.
        network: the cluster.
        policy: a name of :data:`POLICIES`.
        group_size: workers per group (default 2; 1 on one worker).
        local_steps: SGD steps between averagings.
        cross_every: aware: every how many groups a worker crosses nodes.

    Attributes:
        generator: the group generator.
        groups: groups that ran.
    """

    name = "prague"
    uneven = True

    def __init__(
        self,
        workers: Workers,
        network: Network,
        *,
        policy: str = "smart",
        group_size: int | None = None,
        local_steps: int = 1,
        cross_every: int = 2,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not simulated; simulated: {', '.join(POLICIES)}")
        if local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {local_steps}")
        n = workers.n
        self.workers, self.network, self.local_steps = workers, network, local_steps
        self.generator = GroupGenerator(
            n,
            min(2, n) if group_size is None else group_size,
            policy,
            seed=workers.seed,
            nodes=network.node_of if policy == "aware" else None,
            cross_every=cross_every,
            clock=network.engine.clock,
        )
        self.groups = 0
        self._inbox: list[deque[tuple[Group, bool]]] = [deque() for _ in range(n)]
        self._taking = [False] * n  # in average() or settle(): taking its notifications
        self._running: list[Group | None] = [None] * n
        self._serves = [False] * n  # whether the group it runs serves its request
        self._since = [0.0] * n
        self._joined: dict[int, int] = {}
        self._ticking = False
        self._budget = 0
        self._total = 0

    def epoch(self, epoch: int) -> None:
        """Run ``epoch`` (its budget of n x S steps) to its settled end."""
        w = self.workers
        self._budget += w.n * w.steps
        self._taking = [False] * w.n  # the pause is over
        for i in range(w.n):
            self._compute(i)
        self.network.engine.run()
        assert self.generator.finished, "the epoch ended with workers not paused"
        self.generator.reopen()

    def _compute(self, i: int) -> None:
        if self._total >= self._budget:  # the epoch is over: this worker pauses
            self._taking[i] = True
            self._to_generator(i, "close")
            self._take(i)
            return
        self.workers.gradient(i)
        self.network.engine.after(self.workers.compute_time(i), self._computed, i)

    def _computed(self, i: int) -> None:
        self.workers.update(i)
        if self.workers.iterations[i] % self.local_steps:
            self._stepped(i)
            return
        self._taking[i], self._since[i] = True, self.network.engine.now
        self._to_generator(i, "request")
        self._take(i)

    def _stepped(self, i: int) -> None:
        self._total += 1
        self._compute(i)

    def _to_generator(self, i: int, what: str, gid: int = 0) -> None:
        """Worker ``i``'s message to the group generator (REQUEST, DONE or CLOSE)."""
        delay = self.network.latency(i, SERVICE) if i != SERVICE else 0.0
        self.network.engine.after(delay, self._at_generator, i, what, gid)

    def _at_generator(self, i: int, what: str, gid: int) -> None:
        gg = self.generator
        started = gg.request(i) if what == "request" else gg.done(i, gid) if what == "done" else gg.close(i)
        self._notify(started)

    def _notify(self, started: list[Group]) -> None:
        for group in started:
            for m in group.members:
                delay = self.network.latency(SERVICE, m) if m != SERVICE else 0.0
                self.network.engine.after(delay, self._notified, m, group, m in group.served)
        if self.generator.policy == "aware" and self.generator.waiting and not self._ticking:
            self._ticking = True
            self.network.engine.after(Backoff().longest, self._tick)

    def _tick(self) -> None:
        self._ticking = False
        self._notify(self.generator.tick())

    def _notified(self, m: int, group: Group, serves: bool) -> None:
        self._inbox[m].append((group, serves))
        self._take(m)

    def _take(self, m: int) -> None:
        """Worker ``m`` joins its next notified group if it is taking notifications."""
        if not self._taking[m] or self._running[m] is not None or not self._inbox[m]:
            return
        group, self._serves[m] = self._inbox[m].popleft()
        self._running[m] = group
        self._joined[group.gid] = self._joined.get(group.gid, 0) + 1
        if self._joined[group.gid] == len(group.members):
            del self._joined[group.gid]
            pattern = ring(group.members, self.workers.nbytes)
            self.network.run_phases(pattern, lambda: self._reduced(group))

    def _reduced(self, group: Group) -> None:
        self.workers.average(group.members)
        self.groups += 1
        for m in group.members:
            self._running[m] = None
            self._to_generator(m, "done", group.gid)
            if self._serves[m]:
                self._taking[m] = False
                self.workers.waited[m] += self.network.engine.now - self._since[m]
                self._stepped(m)
            else:
                self._take(m)


__all__ = ["POLICIES", "Prague"]
