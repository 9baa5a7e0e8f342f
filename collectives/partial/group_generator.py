"""The group generator (GG): the lock service that hands out P-Reduce groups.

Pure state machine, no MPI: :mod:`collectives.partial.preduce` runs it in a service
thread and turns its answers into messages. Workers are numbered 0..n-1.

Protocol (Luo et al., "Prague:
High-Performance Heterogeneity-Aware Asynchronous Decentralized Training",
ASPLOS 2020):

1. A worker that finished an iteration sends ``request(w)``.
2. GG keeps one lock bit per worker. It forms a group containing ``w``; if no
   member is locked it locks them all and *starts* the group: every member is
   told (group id, members). Otherwise the group waits in a FIFO queue.
3. Each member runs the P-Reduce of the group and reports ``done(w, gid)``;
   GG clears that member's bit and serves the queue again, in order.

Rules this module fixes (the seed leaves them open):

* **Which request a group serves.** A request is served by the first group
  containing the requester that GG starts after receiving the request. Under
  ``random`` this means: a worker that asks while it is a member of a *pending*
  group (drawn for someone else, not started) draws nothing new — that group,
  the earliest pending one containing it, serves it; a worker that asks while
  it is a member of an *active* group (already started, as N3 in
  {N1,N3,N5} in the seed) gets a new group of its own, which waits until the
  active group releases it. Every started group tells each member whether it
  serves that member's request.
* **Fair queue (no starvation).** The queue is scanned in arrival order; a
  pending group starts iff none of its members is locked *or claimed by an
  earlier pending group*. Non-overlapping groups therefore run concurrently,
  but a later group never takes a worker that an earlier waiting group needs,
  so a waiting group is overtaken only by the finitely many groups ahead of
  it and starts once the active groups holding its members release them.
* **Per-member release.** A member's bit clears as soon as *it* reports done;
  the group retires when all members have. (Its part of the all-reduce is
  finished then: its sends have completed and it holds the result.)
* **State.** When GG is idle (no request outstanding, no group pending or
  active: after a pause) what shapes its next groups is its random
  generator; :meth:`GroupGenerator.state_dict` and ``load_state_dict``
  save and restore it, with the next group id, for checkpoints.
* **Closing.** ``close(w)`` says w will request no more. Closed workers can
  still be drafted (they keep serving groups) until every worker has closed
  and no group is active: then :attr:`GroupGenerator.finished` is true, and
  :meth:`GroupGenerator.reopen` can turn that end into a pause (P-Reduce's
  ``settle()``: every worker may request again).

Policies (:data:`POLICIES`):

``random``
    On a request from w, GG draws w plus ``group_size - 1`` other workers
    uniformly at random (the seed's generator); conflicts wait as above.
``smart``
    Groups are formed only from *idle* workers — those waiting for a group
    (outstanding requests, oldest first), then closed workers — never from a
    worker that is computing. The oldest waiting request leads each group, and
    a group forms as soon as ``group_size`` idle, unlocked workers exist, so
    fast workers are grouped with the other fast workers that are waiting, and
    a slow worker never holds a fast one up. Every waiting member is served.
``aware``
    Like ``smart`` (groups of idle workers only, the oldest waiting request
    leads), but the leader's partners are chosen by place and measured speed
    (:class:`~collectives.partial.placement.Placement`): inside its node first,
    across nodes every ``cross_every``-th group of the leader (to the node it
    exchanges with most cheaply, and in turns to every other), and a leader
    with no idle node mate waits for one that is computing only while that is
    expected to cost less than crossing. GG measures what it needs from the
    messages it gets anyway: a group's time from its start to its last
    member's DONE, inside a node or across, and each worker's step (from the
    DONE of the group that served it to its next REQUEST). A leader that
    waits for time to pass is looked at again by :meth:`GroupGenerator.tick`.
    Leaders that cannot be served yet do not hold up later ones.
``static``
    No service at all: :func:`static_groups` partitions the workers into
    groups of at most ``group_size`` by a permutation drawn from
    (seed, period index); the partition is fixed for ``period`` iterations and
    then rotates (the seed's figure 17). Groups never conflict and every
    worker can compute its own group locally.

Cost: a request is O(n) (draw and queue scan over the pending groups'
members); a done/close re-scans the queue.
"""

from __future__ import annotations

import random
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import ArgumentError
from ..transport.chunks import chunk_bounds
from .placement import SMOOTHING, Placement

#: Group-formation policies.
POLICIES = ("random", "smart", "aware", "static")

#: A group chooser for the random policy: given the requester, the members
#: (requester included) of its group. Used to script the seed's example.
Draw = Callable[[int], Iterable[int]]


@dataclass
class Group:
    """A group of workers formed by the GG.

    Attributes:
        gid: group id, 1, 2, ... in order of formation.
        members: the workers, ascending.
        requester: the worker whose request drew it (random) or leads it (smart).
        formed: clock time it was drawn.
        started: clock time it was started (its members locked), or None.
        served: the workers whose outstanding requests it serves, with how
            long each request had waited when the group started.
        running: members that have not yet reported done.
    """

    gid: int
    members: tuple[int, ...]
    requester: int
    formed: float
    started: float | None = None
    served: dict[int, float] = field(default_factory=dict)
    running: set[int] = field(default_factory=set)
    reported: bool = field(default=False, repr=False)  # its wait has been traced


def check_policy(policy: str) -> None:
    """Raise ArgumentError unless ``policy`` is one of :data:`POLICIES`."""
    if policy not in POLICIES:
        raise ArgumentError(f"unknown policy {policy!r}; valid policies: {', '.join(POLICIES)}")


def check_group_size(group_size: int, n: int) -> None:
    """Raise ArgumentError unless 1 <= ``group_size`` <= ``n``."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or not 1 <= group_size <= n:
        raise ArgumentError(f"group_size must be an integer in 1..{n} (the number of workers), got {group_size!r}")


class GroupGenerator:
    """The GG lock service for ``n`` workers (policies ``random`` and ``smart``).

    Every method returns the groups it started, in start order; the caller
    tells each member of each of them. See the module docstring for the rules.

    Args:
        n: number of workers.
        group_size: members per group (1..n).
        policy: "random" or "smart" ("static" needs no service).
        seed: seed of the random draws.
        draw: replaces the random draw (random policy only): requester ->
            members; groups may then have any size.
        nodes: the node of each worker (aware policy; default: one node).
        cross_every: aware: every how many groups a worker crosses nodes.
        clock: time source for waits (seconds).
        trace: called with one human-readable line per event, or None.
    """

    def __init__(
        self,
        n: int,
        group_size: int,
        policy: str = "random",
        *,
        seed: int = 0,
        draw: Draw | None = None,
        nodes: Sequence[int] | None = None,
        cross_every: int = 2,
        clock: Callable[[], float] = time.monotonic,
        trace: Callable[[str], None] | None = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ArgumentError(f"the number of workers must be a positive integer, got {n!r}")
        check_group_size(group_size, n)
        check_policy(policy)
        if policy == "static":
            raise ArgumentError("the static policy needs no group generator; use static_groups()")
        if draw is not None and policy != "random":
            raise ArgumentError(f"draw= replaces the random policy's draw; it cannot be used with {policy!r}")
        if nodes is not None and len(nodes) != n:
            raise ArgumentError(f"nodes= gives the node of {len(nodes)} workers, not of {n}")
        self.n, self.group_size, self.policy = int(n), int(group_size), policy
        self._rng = random.Random(seed)
        self._draw = draw
        self._clock = clock
        self._t0 = clock()
        self._trace = trace
        self._lock: list[int | None] = [None] * self.n  # gid holding each worker
        self._queue: list[Group] = []  # pending groups, FIFO (random)
        self._active: dict[int, Group] = {}
        self._waiting: dict[int, float] = {}  # outstanding requests, arrival order
        self._closed: set[int] = set()
        self._closing_since: float | None = None  # when the first worker closed (since the last reopen)
        self._next_gid = 1
        self.placement = Placement([0] * self.n if nodes is None else nodes, cross_every)
        self._step_s: dict[int, float] = {}  # aware: each worker's step, from served to next request
        self._served_at: dict[int, float] = {}  # aware: when the group serving the worker's last request ended for it

    # -- state -------------------------------------------------------------

    @property
    def locks(self) -> tuple[int, ...]:
        """The lock vector: 1 for each worker in an active group."""
        return tuple(int(g is not None) for g in self._lock)

    @property
    def pending(self) -> tuple[Group, ...]:
        """Groups drawn but not started, in queue order."""
        return tuple(self._queue)

    @property
    def active(self) -> tuple[Group, ...]:
        """Started groups with members still running, in start order."""
        return tuple(self._active.values())

    @property
    def waiting(self) -> tuple[int, ...]:
        """Workers with an outstanding request, oldest first."""
        return tuple(self._waiting)

    @property
    def finished(self) -> bool:
        """True once every worker has closed and no group is active."""
        return len(self._closed) == self.n and not self._active

    def state_dict(self) -> dict[str, Any]:
        """The state of an idle generator (module docstring), JSON-able: the random
        draws' generator and the next group id."""
        self._check_idle("state_dict")
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "next_gid": self._next_gid}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, a :meth:`state_dict` (while idle)."""
        self._check_idle("load_state_dict")
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._next_gid = int(state["next_gid"])

    # -- events ------------------------------------------------------------

    def request(self, worker: int) -> list[Group]:
        """Worker ``worker`` asks for a group; return the groups started."""
        self._check(worker)
        if worker in self._waiting or worker in self._closed:
            state = "has an outstanding request" if worker in self._waiting else "has closed"
            raise ArgumentError(f"worker {worker} cannot request a group: it {state}")
        if self.policy in ("smart", "aware"):
            now = self._waiting[worker] = self._clock()
            if worker in self._served_at:  # aware: its step since it was served
                step, last = now - self._served_at.pop(worker), self._step_s.get(worker)
                self._step_s[worker] = step if last is None else (1 - SMOOTHING) * last + SMOOTHING * step
            self._log(f"request w{worker}; waiting {workers(self._waiting)}, a group needs {self.group_size} idle")
            return self._schedule()
        queued = next((g for g in self._queue if worker in g.members), None)
        if queued is not None:
            self._log(
                f"request w{worker}: already in pending g{queued.gid} {workers(queued.members)}, which will serve it"
            )
        else:
            queued = Group(self._next_gid, self._drawn(worker), worker, self._clock())
            self._next_gid += 1
            self._queue.append(queued)
            self._log(f"request w{worker}: drew g{queued.gid} {workers(queued.members)}")
        self._waiting[worker] = self._clock()
        return self._schedule()

    def done(self, worker: int, gid: int) -> list[Group]:
        """Member ``worker`` finished group ``gid``: clear its lock; return the groups started."""
        self._check(worker)
        group = self._active.get(gid)
        if group is None or worker not in group.running:
            raise ArgumentError(f"worker {worker} reported done for g{gid}, which it is not running")
        group.running.discard(worker)
        self._lock[worker] = None
        now = self._clock()
        if self.policy == "aware" and worker in group.served:
            self._served_at[worker] = now
        if not group.running:
            del self._active[gid]
            if self.policy == "aware":
                self.placement.exchanged(group.members, now - (group.started or now))
        self._log(f"done w{worker} g{gid}{'' if group.running else ' (group released)'}; locks {self._vector()}")
        return self._schedule()

    def close(self, worker: int) -> list[Group]:
        """Worker ``worker`` will request no more groups; return the groups started."""
        self._check(worker)
        if worker in self._waiting or worker in self._closed:
            raise ArgumentError(
                f"worker {worker} cannot close: it "
                f"{'has an outstanding request' if worker in self._waiting else 'already closed'}"
            )
        self._closed.add(worker)
        if self._closing_since is None:
            self._closing_since = self._clock()
        self._log(f"close w{worker} ({len(self._closed)}/{self.n} closed)")
        return self._schedule()

    def tick(self) -> list[Group]:
        """Time passed without a message: the groups a waiting ``aware`` leader now
        starts (its patience ran out); nothing for the other policies."""
        return self._schedule() if self.policy == "aware" and self._waiting else []

    def reopen(self) -> None:
        """Accept requests again from every worker after all closed and no group is
        active (:attr:`finished`): the end of a pause rather than of the run."""
        if not self.finished:
            raise ArgumentError("reopen() needs every worker closed and no group active")
        self._closed.clear()
        self._closing_since = None
        self._log("reopen: every worker paused and no group is active; requests are accepted again")

    def stalled(self) -> list[tuple[Hashable, float, str]]:
        """Every outstanding request as (key, seconds waited, description naming
        the lock vector and the active groups holding the workers it waits for),
        and, once some worker has closed, the wait for the others to close.

        Read by the stall inspector from another thread: it only reads, each
        field once, and copies the containers first.
        """
        now = self._clock()
        out: list[tuple[Hashable, float, str]] = []
        closing, closed = self._closing_since, sorted(self._closed)
        if closing is not None and 0 < len(closed) < self.n:
            out.append(
                (
                    ("gg-close", closing),
                    now - closing,
                    f"group generator: workers {workers(closed)} called settle() or close(); "
                    f"waiting {now - closing:.0f} s for {workers(w for w in range(self.n) if w not in closed)}",
                )
            )
        for worker, since in list(self._waiting.items()):
            group = next((g for g in list(self._queue) if worker in g.members), None)
            if group is None:  # smart: waits for enough idle workers
                what = f"waits for {self.group_size} idle workers"
                holders = [m for m in range(self.n) if self._lock[m] is not None]
            else:
                what = f"is queued as g{group.gid} {workers(group.members)}"
                holders = [m for m in group.members if self._lock[m] is not None]
            held = "; ".join(
                f"w{m} held by g{gid} {workers(a.members)} (running: {workers(sorted(a.running))})"
                for m in holders
                for gid in [self._lock[m]]
                if gid is not None
                for a in [self._active.get(gid)]
                if a
            )
            out.append(
                (
                    ("gg-request", worker, since),
                    now - since,
                    f"group generator: the request of worker {worker} {what} for {now - since:.0f} s; "
                    f"locks {self._vector()}" + (f"; {held}" if held else ""),
                )
            )
        return out

    # -- internals ---------------------------------------------------------

    def _schedule(self) -> list[Group]:
        started: list[Group] = []
        if self.policy == "aware":
            return self._schedule_aware()
        if self.policy == "smart":
            while self._waiting:
                idle = [w for w in self._waiting if self._lock[w] is None]
                idle += [w for w in sorted(self._closed) if self._lock[w] is None]
                if not idle or idle[0] not in self._waiting or len(idle) < self.group_size:
                    break
                group = Group(self._next_gid, tuple(sorted(idle[: self.group_size])), idle[0], self._clock())
                self._next_gid += 1
                self._start(group)
                started.append(group)
            return started
        claimed: set[int] = set()
        for group in list(self._queue):
            busy = [m for m in group.members if self._lock[m] is not None or m in claimed]
            if busy:
                claimed.update(group.members)
                if not group.reported:
                    group.reported = True
                    why = ", ".join(
                        f"w{m} "
                        + (
                            f"locked by g{self._lock[m]}"
                            if self._lock[m] is not None
                            else "claimed by an earlier pending group"
                        )
                        for m in busy
                    )
                    self._log(
                        f"g{group.gid} {workers(group.members)} waits: {why}; "
                        f"queue [{', '.join(f'g{g.gid}' for g in self._queue)}]"
                    )
                continue
            self._queue.remove(group)
            self._start(group)
            started.append(group)
        return started

    def _schedule_aware(self) -> list[Group]:
        """Every waiting leader, oldest first, gets the partners the placement rules give
        among the idle workers not taken by an earlier leader, or waits."""
        started: list[Group] = []
        now = self._clock()
        idle = [w for w in self._waiting if self._lock[w] is None]
        idle += [w for w in sorted(self._closed) if self._lock[w] is None]
        for leader in [w for w in idle if w in self._waiting]:
            if leader not in idle:  # taken by an earlier leader's group
                continue
            others = [w for w in idle if w != leader]
            partners = self.placement.choose(leader, others, self.group_size - 1)
            if partners is None:
                continue
            home = self.placement.node_of[leader]
            crossing = any(self.placement.node_of[p] != home for p in partners)
            waited, mate = now - self._waiting[leader], self._mate_expected_in(leader, now)
            if crossing and self.placement.worth_waiting(leader, waited, mate):
                continue
            members = tuple(sorted([leader, *partners]))
            group = Group(self._next_gid, members, leader, now)
            self._next_gid += 1
            self._start(group)
            started.append(group)
            idle = [w for w in idle if w not in members]
        return started

    def _mate_expected_in(self, worker: int, now: float) -> float | None:
        """Seconds until the first of ``worker``'s computing node mates is expected to
        request (its last group's end plus its measured step); None if none is known."""
        home = self.placement.node_of[worker]
        expected = [
            self._served_at[m] + self._step_s[m] - now
            for m in range(self.n)
            if m != worker and self.placement.node_of[m] == home and m in self._served_at and m in self._step_s
        ]
        return max(0.0, min(expected)) if expected else None

    def _start(self, group: Group) -> None:
        now = self._clock()
        group.started = now
        group.served = {m: now - self._waiting.pop(m) for m in group.members if m in self._waiting}
        group.running = set(group.members)
        for m in group.members:
            self._lock[m] = group.gid
        self._active[group.gid] = group
        waits = ", ".join(f"w{m} after {t:.6f} s" for m, t in group.served.items())
        self._log(
            f"start g{group.gid} {workers(group.members)} for w{group.requester}; "
            f"serves {waits or 'no request'}; locks {self._vector()}"
        )

    def _drawn(self, worker: int) -> tuple[int, ...]:
        if self._draw is None:
            others = [w for w in range(self.n) if w != worker]
            return tuple(sorted([worker, *self._rng.sample(others, self.group_size - 1)]))
        members = tuple(sorted(int(m) for m in self._draw(worker)))
        if worker not in members or len(set(members)) != len(members) or not all(0 <= m < self.n for m in members):
            raise ArgumentError(
                f"draw({worker}) returned {members}: a group must contain the requester "
                f"and distinct workers in 0..{self.n - 1}"
            )
        return members

    def _check_idle(self, what: str) -> None:
        if self._waiting or self._queue or self._active:
            raise ArgumentError(
                f"{what}() needs an idle group generator; requests outstanding: {workers(self._waiting)}, "
                f"groups pending: {len(self._queue)}, active: {len(self._active)}"
            )

    def _check(self, worker: int) -> None:
        if not 0 <= worker < self.n:
            raise ArgumentError(f"worker {worker} out of range 0..{self.n - 1}")

    def _vector(self) -> str:
        return "[" + ",".join(map(str, self.locks)) + "]"

    def _log(self, line: str) -> None:
        if self._trace is not None:
            self._trace(f"[gg {self._clock() - self._t0:10.6f}] {line}")


def workers(ws: Iterable[int]) -> str:
    """Workers as the trace writes them: {w0,w2,w4}."""
    return "{" + ",".join(f"w{w}" for w in ws) + "}"


def static_groups(n: int, group_size: int, period_index: int, seed: int = 0) -> tuple[tuple[int, ...], ...]:
    """The static schedule's partition of workers 0..n-1 for one period.

    A permutation drawn from (seed, period_index) is cut into ceil(n /
    group_size) consecutive groups whose sizes differ by at most one (so none
    exceeds ``group_size``). Every worker computes the same partition locally.
    """
    check_group_size(group_size, n)
    if period_index < 0 or seed < 0:
        raise ArgumentError(f"period index and seed must be >= 0, got {period_index} and {seed}")
    perm = np.random.default_rng([seed, period_index]).permutation(n)
    bounds = chunk_bounds(n, -(-n // group_size))
    return tuple(tuple(sorted(int(w) for w in perm[lo:hi])) for lo, hi in zip(bounds, bounds[1:]))


def static_group(
    worker: int, iteration: int, n: int, group_size: int, period: int = 1, seed: int = 0
) -> tuple[int, ...]:
    """The group of ``worker`` at ``iteration`` (0, 1, ...) under the static schedule."""
    if period < 1:
        raise ArgumentError(f"period must be >= 1, got {period}")
    return next(g for g in static_groups(n, group_size, iteration // period, seed) if worker in g)
