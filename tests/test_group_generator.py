"""The group generator's state machine, without MPI: the seed's example, fairness,
concurrency, the smart and static policies, bad input, and a simulation of the
whole worker protocol (no deadlock, exact sum preservation)."""

from __future__ import annotations

import json
import random
from collections import deque
from fractions import Fraction
from itertools import combinations

import pytest

from collectives import ArgumentError, GroupGenerator, static_group, static_groups


def scripted(*groups: tuple[int, ...]):
    """A draw that returns the given groups in order (the seed's 'random' picks)."""
    it = iter(groups)
    return lambda requester: next(it)


def release(gg: GroupGenerator, gid: int, order: tuple[int, ...]) -> list:
    """Report done for each member in ``order``; return everything started."""
    return [g for w in order for g in gg.done(w, gid)]


def test_seed_six_worker_example() -> None:
    """Seed 001 figure 16 (N1..N6 are workers 0..5)."""
    lines: list[str] = []
    gg = GroupGenerator(6, 3, draw=scripted((0, 2, 4), (2, 3)), trace=lines.append)
    # Steps 1, 3-5: N1 asks; GG forms {N1,N3,N5}, locks them, notifies them.
    (g1,) = gg.request(0)
    assert g1.members == (0, 2, 4) and gg.locks == (1, 0, 1, 0, 1, 0)
    assert g1.served.keys() == {0}  # N3 and N5 are drafted
    # Steps 2, 6: N3 asks (while in the active {N1,N3,N5}); {N3,N4} overlaps and waits.
    assert gg.request(2) == []
    (g2,) = gg.pending
    assert g2.members == (2, 3) and gg.locks == (1, 0, 1, 0, 1, 0)
    # Step 7: {N1,N3,N5} finishes; the locks clear and {N3,N4} runs (step 8).
    assert release(gg, g1.gid, (0, 4)) == [] and gg.locks == (0, 0, 1, 0, 0, 0)
    assert gg.done(2, g1.gid) == [g2]
    assert gg.locks == (0, 0, 1, 1, 0, 0) and g2.served.keys() == {2}
    # Step 9: {N3,N4} finishes.
    assert release(gg, g2.gid, (2, 3)) == [] and gg.locks == (0,) * 6
    text = "\n".join(lines)
    assert "start g1 {w0,w2,w4} for w0; serves w0 after" in text and "locks [1,0,1,0,1,0]" in text
    assert "g2 {w2,w3} waits: w2 locked by g1" in text
    assert "locks [0,0,0,0,0,0]" in text  # the release of g1, before g2 starts
    assert "start g2 {w2,w3} for w2; serves w2 after" in text and "locks [0,0,1,1,0,0]" in text


def test_request_while_in_pending_group_is_served_by_it() -> None:
    """w1, active in {w0,w1} and drafted into the pending {w1,w2}, asks: that group serves it."""
    gg = GroupGenerator(4, 2, draw=scripted((0, 1), (1, 2)))
    (g1,) = gg.request(0)
    assert gg.request(2) == []  # {w1,w2} waits for w1
    assert gg.request(1) == []  # draws nothing: the script has no third group
    assert [g.members for g in gg.pending] == [(1, 2)] and gg.waiting == (2, 1)
    (g2,) = release(gg, g1.gid, (0, 1))
    assert g2.members == (1, 2) and g2.served.keys() == {1, 2}


def test_fair_queue_claims_block_later_groups() -> None:
    """A waiting group keeps its members: later groups cannot take them first."""
    gg = GroupGenerator(5, 2, draw=scripted((0, 1), (0, 3), (1, 3), (0, 2), (2, 4)))
    (a,) = gg.request(0)  # {w0,w1} active
    assert gg.request(3) == []  # {w0,w3} waits for w0
    assert gg.request(1) == []  # {w1,w3}: w1 locked, and w3 is claimed by {w0,w3}
    assert gg.request(2) == []  # {w0,w2} waits behind {w0,w3}
    assert gg.request(4) == []  # {w2,w4}: w2 is free but claimed by {w0,w2}
    assert [g.members for g in gg.pending] == [(0, 3), (1, 3), (0, 2), (2, 4)]
    started = release(gg, a.gid, (1, 0))
    assert [g.members for g in started] == [(0, 3)]  # first in line, although w1 was freed first
    started = release(gg, started[0].gid, (3, 0))
    assert [g.members for g in started] == [(1, 3), (0, 2)]  # disjoint: both run
    b, c = started
    assert len(gg.active) == 2
    assert [g.members for g in release(gg, c.gid, (0, 2))] == [(2, 4)]
    assert release(gg, b.gid, (1, 3)) == [] and gg.pending == ()


def test_repeatedly_conflicting_requests_are_served_in_turn() -> None:
    """Everyone wants w0: each request waits only for those ahead of it, round robin."""
    gg = GroupGenerator(6, 2, draw=lambda w: (0, w) if w else (0, 1))
    (g,) = gg.request(0)
    for w in (3, 2, 4, 5):
        assert gg.request(w) == []
    order = []
    for _ in range(12):
        helper = g.members[1]
        (g,) = release(gg, g.gid, (helper, 0))
        order.append(g.members[1])
        assert gg.request(helper) == []  # asks again at once: back of the queue
    assert order == [3, 2, 4, 5, 1] * 2 + [3, 2]


def test_non_overlapping_groups_run_concurrently() -> None:
    gg = GroupGenerator(6, 2, draw=scripted((0, 1), (2, 3), (4, 5)))
    for w in (0, 2, 4):
        assert len(gg.request(w)) == 1
    assert len(gg.active) == 3 and gg.locks == (1,) * 6


def test_random_draw_is_seeded_and_contains_requester() -> None:
    def draws(seed: int) -> list:
        gg = GroupGenerator(8, 3, seed=seed)
        for w in range(8):
            gg.request(w)
        return [(g.requester, g.members) for g in gg.active + gg.pending]

    first = draws(7)
    assert first == draws(7) and first != draws(8)
    assert all(r in m and len(m) == 3 for r, m in first)


def test_an_idle_generators_state_continues_its_draws() -> None:
    """A checkpoint's state (through JSON) makes another generator draw the same groups
    with the same ids; it is refused while a request is outstanding."""

    def serve_all(gg: GroupGenerator, order: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        """Requests from ``order`` one at a time, each group run to completion."""
        out = []
        for w in order:
            for g in gg.request(w):
                out.append((g.gid, g.members))
                release(gg, g.gid, g.members)
        return out

    gg = GroupGenerator(8, 3, seed=7)
    serve_all(gg, [5, 1, 6])
    state = json.loads(json.dumps(gg.state_dict()))
    copy = GroupGenerator(8, 3, seed=8)
    copy.load_state_dict(state)
    order = [0, 4, 2, 7, 3]
    assert serve_all(copy, order) == serve_all(gg, order)
    gg.request(1)
    with pytest.raises(ArgumentError, match=r"state_dict\(\) needs an idle group generator; requests outstanding"):
        gg.state_dict()


def test_smart_groups_waiting_workers_only() -> None:
    gg = GroupGenerator(6, 3, "smart")
    assert gg.request(4) == [] and gg.request(2) == []  # two idle workers: not enough
    (g,) = gg.request(5)
    assert g.members == (2, 4, 5) and g.requester == 4 and g.served.keys() == {2, 4, 5}
    assert gg.locks == (0, 0, 1, 0, 1, 1)  # computing workers never drafted
    gg.close(0), gg.close(1)
    (h,) = gg.request(3)  # closed workers are idle too
    assert h.members == (0, 1, 3) and h.served.keys() == {3}


def test_smart_oldest_request_leads() -> None:
    gg = GroupGenerator(5, 2, "smart")
    assert gg.request(0) == []
    (g,) = gg.request(1)
    assert gg.request(2) == []
    gg.done(0, g.gid)  # w0 free again, but w0 has no request
    (h,) = gg.request(3)
    assert h.members == (2, 3) and h.requester == 2


@pytest.mark.parametrize("n,k", [(n, k) for n in range(1, 10) for k in range(1, n + 1)])
def test_static_schedule_partitions_every_period(n: int, k: int) -> None:
    periods = [static_groups(n, k, p, seed=3) for p in range(6)]
    for groups in periods:
        members = [w for g in groups for w in g]
        assert sorted(members) == list(range(n))  # covers everyone, no conflict
        assert all(1 <= len(g) <= k for g in groups)
        assert max(map(len, groups)) - min(map(len, groups)) <= 1
    assert periods == [static_groups(n, k, p, seed=3) for p in range(6)]  # computable anywhere
    if n >= 4 and 1 < k < n:
        assert len(set(periods)) > 1  # rotates


def test_static_group_fixed_within_a_period() -> None:
    groups = [static_group(5, it, 8, 2, period=2, seed=1) for it in range(8)]
    assert groups[0] == groups[1] and groups[2] == groups[3] and 5 in groups[0]
    assert all(
        static_group(w, 3, 8, 2, 2, 1) == static_group(m, 3, 8, 2, 2, 1)
        for w in range(8)
        for m in static_group(w, 3, 8, 2, 2, 1)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: GroupGenerator(4, 0),
        lambda: GroupGenerator(4, 5),
        lambda: GroupGenerator(4, 2.5),
        lambda: GroupGenerator(0, 1),
        lambda: GroupGenerator(4, 2, "fastest"),
        lambda: GroupGenerator(4, 2, "static"),
        lambda: GroupGenerator(4, 2, "smart", draw=lambda w: (w,)),
        lambda: static_groups(4, 0, 0),
        lambda: static_group(0, 0, 4, 2, period=0),
    ],
)
def test_bad_arguments(make) -> None:
    with pytest.raises(ArgumentError):
        make()


def test_protocol_misuse_is_rejected() -> None:
    gg = GroupGenerator(3, 2, draw=scripted((0, 1), (1, 2), (1,)))
    (g,) = gg.request(0)
    assert gg.request(2) == []  # {w1,w2} waits
    with pytest.raises(ArgumentError, match="outstanding request"):
        gg.request(2)
    with pytest.raises(ArgumentError, match="outstanding request"):
        gg.close(2)
    with pytest.raises(ArgumentError, match="not running"):
        gg.done(2, g.gid)
    with pytest.raises(ArgumentError, match="out of range"):
        gg.request(3)
    with pytest.raises(ArgumentError, match="must contain the requester"):
        gg.request(0)  # draws (1,)
    assert gg.waiting == (2,)  # the bad request left no trace
    gg.close(0)
    with pytest.raises(ArgumentError, match="has closed"):
        gg.request(0)
    with pytest.raises(ArgumentError, match="already closed"):
        gg.close(0)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_aware_waits_for_a_node_mate_due_soon_not_for_a_straggler() -> None:
    """Four workers on two nodes. Measured: 2 ms inside a node, 50 ms across, so crossing
    costs 48 ms more; w1 is a straggler (a 200 ms step), the others take 6-8 ms."""
    clock = Clock()
    clock.now = 0.0
    gg = GroupGenerator(4, 2, "aware", nodes=[0, 0, 1, 1], cross_every=10, clock=clock)

    def at(t: float, *requests: int) -> list[tuple[int, ...]]:
        clock.now = t
        return [g.members for w in requests for g in gg.request(w)]

    def finish(t: float, members: tuple[int, ...]) -> None:
        clock.now = t
        (group,) = [g for g in gg.active if g.members == members]
        for m in members:
            gg.done(m, group.gid)

    assert at(0.000, 0, 1) == [(0, 1)]
    finish(0.002, (0, 1))
    assert at(0.002, 2, 3) == [(2, 3)]
    finish(0.004, (2, 3))
    assert at(0.010, 0, 2) == [(0, 2)]  # no step of w1 known yet: w0 crosses at once
    finish(0.060, (0, 2))
    # w1 (step 200 ms) and w3 ask; each one's node mate is due at once: both wait for it
    assert at(0.202, 1) == [] and at(0.203, 3) == []
    assert at(0.210, 0) == [(0, 1)] and at(0.211, 2) == [(2, 3)]
    finish(0.212, (0, 1))
    finish(0.213, (2, 3))
    # w0's node mate is the straggler, due in 191 ms: w0 crosses rather than wait
    assert at(0.220, 0) == [] and at(0.221, 2) == [(0, 2)]
    finish(0.271, (0, 2))
    # w1 and w3 wait for their mates, due already; when those stay away as long as
    # crossing would cost more (48 ms), the next tick crosses
    assert at(0.412, 1) == [] and at(0.413, 3) == []
    clock.now = 0.450
    assert gg.tick() == []
    clock.now = 0.462
    assert [g.members for g in gg.tick()] == [(1, 3)]


def test_stalled_reports_each_wait_once_under_its_own_key() -> None:
    """The stall inspector reports a key once: a worker's second wait, for a request or
    for the others to close, has a key of its own, so it is reported too."""
    clock = Clock()
    gg = GroupGenerator(3, 2, draw=scripted((0, 1), (1, 2), (0, 1), (1, 2)), clock=clock)
    (g,) = gg.request(0)
    assert gg.request(2) == []  # {w1,w2} waits for w1, held by g
    clock.now += 5
    ((first, age, message),) = gg.stalled()
    assert age == 5 and "request of worker 2 is queued" in message and "w1 held by g1 {w0,w1}" in message
    (g2,) = release(gg, g.gid, (0, 1))
    release(gg, g2.gid, (1, 2))
    assert gg.stalled() == []
    (g3,) = gg.request(0)
    assert gg.request(2) == []  # w2's next request waits again
    ((second, _, _),) = [r for r in gg.stalled() if "worker 2" in r[2]]
    assert second != first
    release(gg, g3.gid, (0, 1))


def test_stalled_names_the_workers_a_pause_waits_for() -> None:
    clock = Clock()
    gg = GroupGenerator(3, 2, draw=scripted(), clock=clock)
    gg.close(0)
    clock.now += 1
    gg.close(2)
    clock.now += 2
    ((key, age, message),) = gg.stalled()
    assert age == 3
    assert message == "group generator: workers {w0,w2} called settle() or close(); waiting 3 s for {w1}"
    gg.close(1)
    assert gg.finished and gg.stalled() == []
    gg.reopen()
    gg.close(1)
    clock.now += 1
    ((again, age, message),) = gg.stalled()  # the next pause: a new key
    assert again != key and age == 1
    assert message.endswith("workers {w1} called settle() or close(); waiting 1 s for {w0,w2}")


def simulate(n: int, k: int, policy: str, iterations: int, seed: int) -> None:
    """Run the worker protocol of collectives.partial.preduce against the GG, one random action at a time.

    Each worker computes, calls average() ``iterations`` times, then close().
    Inside those calls it takes its notifications in order; a group's
    all-reduce runs once every member has it at the head of its inbox. Checks
    no deadlock, one group per worker at a time, every request served exactly
    once, FIFO among overlapping random groups, and the exact sum. The aware
    policy sees nodes of two workers (the last alone where n is odd) and a
    clock that one action moves by a random amount.
    """
    rng = random.Random(seed)
    clock = Clock()
    nodes = [w // 2 for w in range(n)] if policy == "aware" else None
    gg = GroupGenerator(n, k, policy, seed=seed, nodes=nodes, clock=clock)
    value = [Fraction(rng.randint(-50, 50)) for _ in range(n)]
    total = sum(value)
    left = [iterations] * n
    state = ["compute"] * n  # compute | in_call | closing
    inbox: list[deque] = [deque() for _ in range(n)]
    served = [0] * n
    started_order: list = []

    def deliver(groups: list) -> None:
        for g in groups:
            started_order.append(g)
            for m in g.members:
                inbox[m].append(g)

    while not gg.finished:
        actions = [("step", w) for w in range(n) if state[w] == "compute"]
        heads: dict[int, list[int]] = {}
        for w in range(n):
            if state[w] != "compute" and inbox[w]:
                heads.setdefault(inbox[w][0].gid, []).append(w)
        actions += [("run", inbox[ws[0]][0]) for ws in heads.values() if len(ws) == len(inbox[ws[0]][0].members)]
        assert actions, f"deadlock: states {state}, inboxes {[[g.gid for g in q] for q in inbox]}"
        kind, x = rng.choice(actions)
        clock.now += rng.random() * 0.01
        deliver(gg.tick())
        if kind == "step":
            if left[x]:
                left[x] -= 1
                state[x] = "in_call"
                deliver(gg.request(x))
            else:
                state[x] = "closing"
                deliver(gg.close(x))
        else:
            mean = sum(value[m] for m in x.members) / len(x.members)
            for m in x.members:
                value[m] = mean
                assert inbox[m].popleft() is x
                deliver(gg.done(m, x.gid))
                if m in x.served:
                    assert state[m] == "in_call"
                    served[m] += 1
                    state[m] = "compute"
        locked = [m for g in gg.active for m in g.running]
        assert len(locked) == len(set(locked)), "a worker in two active groups"
        assert all(len(q) <= 1 for q in inbox), "more than one unread notification"
    assert sum(value) == total
    assert served == [iterations] * n and state == ["closing"] * n and not any(inbox)
    if policy == "random":
        for a, b in combinations(started_order, 2):
            if set(a.members) & set(b.members):
                assert a.gid < b.gid, f"g{b.gid} overtook the overlapping g{a.gid}"


@pytest.mark.parametrize("policy", ["random", "smart", "aware"])
@pytest.mark.parametrize("n", range(1, 9))
def test_protocol_simulation(policy: str, n: int) -> None:
    for k in range(1, n + 1):
        for seed in range(4):
            simulate(n, k, policy, iterations=12, seed=seed)
