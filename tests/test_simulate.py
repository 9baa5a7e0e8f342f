"""mpidl simulate: the network model's exact times, the simulated algorithms' numerics and steps, the command.

The network tests and the small numerics run on every rank (no communication);
the runs of many simulated steps run on rank 0 while the others wait
(``on_rank0_quietly``); the comparison with a real run uses two ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpitest import comm_of_size, on_rank0_quietly

from mpidl import cli, data, train
from mpidl.simulate import Engine, Links, Network, SimConfig, parse_rate, simulate
from mpidl.simulate.adpsgd import ADPSGD
from mpidl.simulate.network import max_min_rates
from mpidl.simulate.patterns import hierarchical_ring, ring
from mpidl.simulate.prague import Prague
from mpidl.simulate.workers import Workers

B, INTRA, ALPHA, ALPHA_INTRA = 125e6, 2e9, 2e-5, 5e-6
LINKS = Links(B, INTRA, ALPHA, ALPHA_INTRA)
M = 3_000_000.0


def ends(node_of: list[int], flows: list[tuple[int, int, float]]) -> list[float]:
    """When each of ``flows``, all started at time 0, ends."""
    engine = Engine()
    net = Network(engine, node_of, LINKS)
    out = [0.0] * len(flows)
    for k, (src, dst, nbytes) in enumerate(flows):
        net.transfer(src, dst, nbytes, lambda k=k: out.__setitem__(k, engine.now))
    engine.run()
    return out


def test_a_lone_flow_takes_alpha_plus_m_over_b() -> None:
    assert ends([0, 1], [(0, 1, M)]) == [pytest.approx(ALPHA + M / B, rel=1e-12)]
    assert ends([0, 0], [(0, 1, M)]) == [pytest.approx(ALPHA_INTRA + M / INTRA, rel=1e-12)]
    assert ends([0, 1], [(1, 0, 0.0)]) == [pytest.approx(ALPHA, rel=1e-12)]


def test_two_flows_share_a_nic_fairly() -> None:
    both = ends([0, 1, 2], [(0, 1, M), (0, 2, M)])  # one up link: B/2 each
    assert both == [pytest.approx(ALPHA + 2 * M / B, rel=1e-12)] * 2
    into = ends([0, 1, 2], [(1, 0, M), (2, 0, M)])  # one down link
    assert into == [pytest.approx(ALPHA + 2 * M / B, rel=1e-12)] * 2
    apart = ends([0, 1, 2, 3], [(0, 1, M), (2, 3, M)])  # no link shared: B each
    assert apart == [pytest.approx(ALPHA + M / B, rel=1e-12)] * 2
    short, long = ends([0, 1, 2], [(0, 1, M), (0, 2, 2 * M)])  # B/2 each until the short one ends
    assert short == pytest.approx(ALPHA + 2 * M / B, rel=1e-12)
    assert long == pytest.approx(ALPHA + 3 * M / B, rel=1e-12)


def test_max_min_gives_the_unshared_capacity_to_the_others() -> None:
    # Links 0..3 up, 4..7 down, one unlimited (8); three flows out of node 0 and one
    # from node 3 into node 1: node 0's up link gives each of its flows B/3, so the
    # flow from node 3 gets the 2B/3 left on node 1's down link.
    capacity = np.array([B] * 8 + [np.inf])
    flows = np.array([[0, 5], [0, 6], [0, 7], [3, 5]])
    assert max_min_rates(capacity, flows) == pytest.approx([B / 3, B / 3, B / 3, 2 * B / 3], rel=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_allreduce_takes_its_textbook_time(n: int) -> None:
    expected = 2 * (n - 1) * (ALPHA + M / (n * B))
    engine = Engine()
    net = Network(engine, list(range(n)), LINKS)
    assert net.alone(ring(range(n), M)) == pytest.approx(expected, rel=1e-12)
    done: list[float] = []
    net.run_phases(ring(range(n), M), lambda: done.append(engine.now))
    engine.run()
    assert done == [pytest.approx(expected, rel=1e-12)]
    assert net.sent.sum() == pytest.approx(2 * (n - 1) * M)


def test_hierarchical_ring_is_node_trees_and_a_leaders_ring() -> None:
    nodes = [0, 0, 1, 1, 2, 2]  # two workers per node: one intra-node step each way
    net = Network(Engine(), nodes, LINKS)
    tree = ALPHA_INTRA + M / INTRA
    assert net.alone(hierarchical_ring(nodes, M)) == pytest.approx(2 * tree + 2 * 2 * (ALPHA + M / (3 * B)), rel=1e-12)


def test_bad_input_is_named() -> None:
    assert parse_rate("1gbit") == 125e6 and parse_rate("100mbit") == 12.5e6 and parse_rate("125mbps") == 125e6
    for text in ("fast", "0gbit", "-1gbit"):
        with pytest.raises(ValueError, match="link rate"):
            parse_rate(text)
    with pytest.raises(ValueError, match="two workers"):
        Network(Engine(), [0, 1], LINKS).transfer(1, 1, 10, lambda: None)
    with pytest.raises(ValueError, match="not simulated"):
        simulate(SimConfig(algorithm="dpsgd"))


@pytest.fixture(scope="module")
def digits() -> data.Dataset:
    return data.load_digits().normalized()


def workers(n: int, dataset: data.Dataset, lr: float = 0.05, **kw) -> Workers:
    return Workers(n, dataset, (16,), batch_size=8, lr=lr, momentum=0.9, seed=0, step_time=0.1, **kw)


@pytest.mark.parametrize(
    "make",
    [
        lambda w, net: ADPSGD(w, net),
        lambda w, net: Prague(w, net, policy="smart"),
        lambda w, net: Prague(w, net, policy="random"),
        lambda w, net: Prague(w, net, policy="aware", group_size=3),
    ],
    ids=["adpsgd", "prague-smart", "prague-random", "prague-aware"],
)
@pytest.mark.parametrize("n", [3, 6])
def test_asynchronous_averaging_keeps_the_sum_at_lr_0(make, n: int, digits: data.Dataset) -> None:
    w = workers(n, digits, lr=0.0, slow={n - 1: 4.0})
    w.params[...] = np.random.default_rng(n).standard_normal(w.params.shape).astype(np.float32)
    before = w.params.astype(np.float64).sum(axis=0)
    spread = w.evaluate()[2]
    net = Network(Engine(), [i // 2 for i in range(n)], LINKS)
    schedule = make(w, net)
    w.begin_epoch(1, uneven=True)
    schedule.epoch(1)
    assert w.taken >= n * w.steps
    assert np.allclose(w.params.astype(np.float64).sum(axis=0), before, rtol=0, atol=1e-4)
    assert w.evaluate()[2] < spread / 4  # they averaged: consensus


def run_straggler(algorithm: str, dataset: data.Dataset, **options) -> list[int]:
    config = SimConfig(algorithm, options, workers=8, hidden=(16,), epochs=3, batch_size=8, slow={7: 4.0})
    return simulate(config, dataset).workers["steps"]


def test_a_4x_straggler_slows_allreduce_and_not_the_asynchronous(digits: data.Dataset) -> None:
    def check() -> None:
        steps = run_straggler("allreduce", digits)
        assert steps == [steps[0]] * 8
        # AD-PSGD's slow worker waits for no one: a quarter of the others' steps. Prague's
        # seven fast workers pair among themselves, one of them waiting for the next to
        # come: the slow one takes 0.3 of theirs (0.31 on the emulated cluster at 16).
        for algorithm, options, bounds in (("adpsgd", {}, (0.22, 0.28)), ("prague", {"policy": "smart"}, (0.22, 0.4))):
            steps = run_straggler(algorithm, digits, **options)
            ratio = steps[7] / np.median(steps[:7])
            assert bounds[0] < ratio < bounds[1], (algorithm, steps)

    on_rank0_quietly(check)


def test_simulated_allreduce_sgd_is_the_real_one(digits: data.Dataset) -> None:
    """The simulated workers hold the bits of a real run's on the same seeds (at most two
    ranks: the sum of two gradients does not depend on its order), all alike."""
    comm = comm_of_size(2)
    common = {"hidden": (16,), "epochs": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "seed": 3}
    real = train.train(
        train.TrainConfig(
            algorithm="allreduce",
            options={"collective": "ring"},
            dataset="digits",
            backend="numpy",
            progress=False,
            **common,
        ),
        comm,
    )
    sim = simulate(SimConfig("allreduce", workers=comm.Get_size(), dataset="digits", **common), digits)
    assert np.array_equal(sim.params[comm.Get_rank()], real.params)
    assert (sim.params == sim.params[0]).all()
    assert [e["test_acc"] for e in sim.epochs] == pytest.approx([e["test_acc"] for e in real.epochs], abs=1e-3)


def test_the_command_simulates_16_workers(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    def run() -> tuple[int, str]:
        argv = ["simulate", "--algorithm", "adpsgd", "--workers", "16", "--dataset", "digits", "--hidden", "16"]
        argv += ["--epochs", "2", "--slow", "15:4", "--target", "0.5", "--json", str(tmp_path / "sim.json")]
        status = cli.main(argv)
        return status, capsys.readouterr().out

    status, out = on_rank0_quietly(run)
    assert status == 0
    assert "epoch   2/2" in out and "to 50%:" in out
    status = on_rank0_quietly(lambda: cli.main(["simulate", "--algorithm", "adpsgd", "--policy", "smart"]))
    assert status == 2
