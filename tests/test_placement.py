"""Partners by place and measured speed (collectives/partial/placement.py): the rules, one by
one (the group generator's ``aware`` policy on them: tests/test_group_generator.py)."""

from __future__ import annotations

from collectives.partial.placement import Placement

#: Eight workers, two per node: nodes 0..3.
PAIRS = [w // 2 for w in range(8)]


def test_inside_the_node_first_and_across_every_kth_exchange() -> None:
    p = Placement(PAIRS, cross_every=3)
    chosen = []
    for _ in range(6):
        (partner,) = p.choose(0, [2, 1, 4], 1)  # oldest first: 2, 1, 4
        chosen.append(partner)
        p.exchanged([0, partner])
    assert chosen == [1, 1, 2, 1, 1, 2]  # w1 is w0's node mate; every third crosses


def test_a_worker_alone_on_its_node_always_crosses() -> None:
    p = Placement([0, 1, 1, 2], cross_every=5)
    assert p.due(0) and p.choose(0, [1, 2], 1) == [1]
    assert p.choose(0, [], 1) is None


def test_crossing_takes_the_cheap_link_and_visits_every_node_in_turn() -> None:
    """Node 1's link is 10x dearer (measured by w0's node mate w1): w0's crossings take the
    cheapest node, but every fourth goes to the node it crossed to least recently, so
    that nodes 1 and 3 are reached too."""
    p = Placement(PAIRS, cross_every=1, explore_every=4)
    p.exchanged([1, 4], 0.01)  # nodes 0 and 2
    p.exchanged([1, 6], 0.01)  # nodes 0 and 3
    p.exchanged([1, 2], 0.10)  # nodes 0 and 1: the slow link
    assert p.cost_between(0, 1) == 0.10 and p.cost_between(2, 3) == 0.01  # unmeasured: the dearer link's
    assert p.cost_between(1, 3) == 0.10
    went = []
    for _ in range(8):
        (partner,) = p.choose(0, [2, 4, 6], 1)
        went.append(PAIRS[partner])
        p.exchanged([0, partner])
    assert went == [2, 2, 2, 1, 2, 2, 2, 3]


def test_waiting_for_a_node_mate_only_while_it_is_cheaper_than_crossing() -> None:
    p = Placement(PAIRS, cross_every=4)
    assert not p.worth_waiting(0, 0.0, 0.001)  # nothing measured: crossing costs nothing more
    p.exchanged([0, 1], 0.002)
    p.exchanged([0, 2], 0.050)
    assert abs(p.crossing_cost(0) - 0.048) < 1e-12
    assert p.worth_waiting(0, 0.010, 0.020)  # expected soon, waited little
    assert not p.worth_waiting(0, 0.010, 0.100)  # a straggler: cross now
    assert not p.worth_waiting(0, 0.060, 0.001)  # waited as long as crossing costs
    assert not p.worth_waiting(0, 0.0, None)  # no estimate
