"""The cost model's formulas, calibration, persistence and automatic choice."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok

import collectives
from collectives.topology.layout import Layout
from collectives.tuning import calibration, costmodel
from collectives.tuning.costmodel import Params

A, B, G = 3e-6, 2e-10, 5e-11
FLAT = Params(alpha_intra=A, beta_intra=B, alpha_inter=A, beta_inter=B, gamma=G, overhead=0.0)
N = 1 << 20


def one_node(p: int) -> Layout:
    return Layout((0,) * p)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8, 16])
def test_textbook_forms(p: int) -> None:
    lay, n = one_node(p), float(N)
    lg, pof2 = math.log2(p), 1 << (p.bit_length() - 1)
    assert costmodel.ring(FLAT, lay, n) == pytest.approx(
        2 * (p - 1) * A + 2 * n * (p - 1) / p * B + n * (p - 1) / p * G
    )
    if p == pof2:
        assert costmodel.halving_doubling(FLAT, lay, n) == pytest.approx(
            2 * lg * A + 2 * n * (p - 1) / p * B + n * (p - 1) / p * G
        )
        assert costmodel.butterfly(FLAT, lay, n) == pytest.approx(lg * (A + n * B + n * G))
    else:  # MPICH's non-power-of-two form, with p' = 2^floor(lg p)
        q = pof2
        assert costmodel.halving_doubling(FLAT, lay, n) == pytest.approx(
            (2 * math.floor(lg) + 2) * A + (2 * (q - 1) / q + 2) * n * B + n * (1 + (q - 1) / q) * G
        )
    steps = math.ceil(lg)
    assert costmodel.reduce_broadcast(FLAT, lay, n) == pytest.approx(2 * steps * (A + n * B) + steps * n * G)


@pytest.mark.parametrize("x, y", [(2, 2), (4, 2), (2, 4), (3, 3)])
def test_torus_form(x: int, y: int) -> None:
    p, n = x * y, float(N)
    t = costmodel.torus2d(FLAT, Layout(tuple(r // x for r in range(p))), n)
    assert t == pytest.approx(2 * (x + y - 2) * A + 2 * n * (p - 1) / p * B + n * (p - 1) / p * G)


def test_inter_node_links_cost_more() -> None:
    prm = Params(alpha_intra=A, beta_intra=B, alpha_inter=10 * A, beta_inter=10 * B, gamma=G, overhead=0.0)
    two_nodes = Layout((0, 0, 0, 0, 1, 1, 1, 1))
    # hierarchical ring: binomial inside 4-rank nodes (2 steps each way) + a 2-leader ring over the slow link
    expected = 2 * 2 * (A + N * B) + 2 * N * G + 2 * (10 * A + N / 2 * 10 * B) + N / 2 * G
    assert costmodel.hierarchical_ring(prm, two_nodes, N) == pytest.approx(expected)
    assert costmodel.ring(prm, two_nodes, N) > costmodel.ring(prm, one_node(8), N)


@pytest.mark.parametrize("p", [2, 3, 8])
def test_shared_memory_form(p: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives.kernels.shm, "SEGMENT", 1 << 18)
    prm = Params(
        alpha_intra=A,
        beta_intra=B,
        alpha_inter=10 * A,
        beta_inter=10 * B,
        gamma=G,
        overhead=0.0,
        alpha_shm=A / 3,
        beta_shm=B / 2,
    )
    pieces = N // (1 << 18)
    one_node_time = (pieces + (p > 2)) * A / 3 + N * B / 2  # sliced on more than two ranks: one barrier more
    assert costmodel.shm(prm, one_node(p), N) == pytest.approx(one_node_time)
    two_nodes = Layout(tuple(r // p for r in range(2 * p)))  # two nodes of p: + leaders' ring + broadcast
    leaders = 2 * (10 * A + N / 2 * 10 * B) + N / 2 * G
    assert costmodel.shm(prm, two_nodes, N) == pytest.approx(one_node_time + leaders + pieces * A / 3 + N * B / 2)
    assert costmodel.shm(prm, Layout((0, 1)), N) == pytest.approx(leaders)  # one rank per node: the ring alone


def test_check_costs_nothing_where_it_rides_along() -> None:
    from collectives.validation import FUSE_LIMIT

    prm = Params(
        alpha_intra=A, beta_intra=B, alpha_inter=10 * A, beta_inter=10 * B, gamma=G, overhead=0.0, alpha_shm=A / 3
    )
    node, nodes = one_node(4), Layout((0, 0, 1, 1, 2))
    assert costmodel.check_cost("shm", N, node, prm) == 0.0
    assert costmodel.check_cost("ring", N, node, prm) == pytest.approx(A / 3)  # one shared-memory barrier
    assert costmodel.check_cost("butterfly", FUSE_LIMIT, nodes, prm) == 0.0  # the data rides in the check
    header_exchange = 10 * A + 2 * 48 * 10 * B
    assert costmodel.check_cost("butterfly", FUSE_LIMIT + 1, nodes, prm) == pytest.approx(3 * header_exchange)
    assert costmodel.check_cost("shm", 64, nodes, prm) == pytest.approx(3 * header_exchange)
    ring = costmodel.predict("ring", N, node, prm)
    assert costmodel.predict("ring", N, node, prm, validate=True) == pytest.approx(ring + A / 3)


def test_choice_orders_latency_and_bandwidth() -> None:
    lay = one_node(8)
    passing = [name for name in costmodel.MODELS if name != "shm"]
    small, large = costmodel.choose(64, lay, FLAT, candidates=passing), costmodel.choose(64 << 20, lay, FLAT)
    assert small.algorithm == "butterfly"
    assert large.algorithm in ("ring", "halving_doubling", "torus2d", "shm")
    assert list(small.predictions) == sorted(small.predictions, key=small.predictions.get)
    assert set(small.predictions) == set(passing) and set(large.predictions) == set(costmodel.MODELS)
    assert small.algorithm in small.reason and "predicted" in small.reason


def test_params_round_trip(tmp_path) -> None:
    path = tmp_path / "model.json"
    prm = dataclasses.replace(FLAT, offset={"ring": 2e-6, "reduce_broadcast": -3e-6})
    prm.save(str(path))
    assert Params.load(str(path)) == prm


def test_offsets_shift_one_algorithm() -> None:
    """An algorithm's offset moves its prediction by that much at every size, and no other's."""
    lay = one_node(4)
    shifted = dataclasses.replace(FLAT, offset={"reduce_broadcast": -5 * A})
    for n in (8, 1 << 20):
        for name in costmodel.MODELS:
            delta = costmodel.predict(name, n, lay, shifted) - costmodel.predict(name, n, lay, FLAT)
            assert delta == pytest.approx(-5 * A if name == "reduce_broadcast" else 0.0)
    assert (
        costmodel.choose(64, lay, shifted, candidates=["butterfly", "reduce_broadcast"]).algorithm == "reduce_broadcast"
    )


@pytest.mark.mpi
def test_calibration_explain_and_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    comm = MPI.COMM_WORLD
    empty = np.zeros(0, np.float32)
    prm = calibration.calibrate(
        comm,
        collectives.topology.layout.layout(comm, "1"),
        entry=lambda: collectives.allreduce(empty, comm, algorithm="ring", validate=False),
    )
    assert prm.alpha_intra > 0 and prm.beta_inter > 0 and prm.gamma > 0 and prm.overhead > 0
    # every message-passing algorithm's measured latency: its 8-byte prediction stays positive
    passing = {name for name in costmodel.MODELS if name != "shm"}
    assert set(prm.offset) == (passing if comm.Get_size() > 1 else set())
    assert all(
        costmodel.MODELS[name](prm, collectives.topology.layout.layout(comm, "1"), 8.0) + prm.offset[name] > 0
        for name in prm.offset
    )
    choice = collectives.explain(1 << 16, comm)
    assert choice.algorithm in costmodel.MODELS and choice.predictions[choice.algorithm] == min(
        choice.predictions.values()
    )
    with caplog.at_level(logging.DEBUG, logger="collectives.auto"):
        x = np.ones(12345, np.float32)
        collectives.allreduce(x, comm, algorithm="auto")
    assert all_ok(
        comm, any(r.getMessage().startswith("auto: ") and " for 49380 B " in r.getMessage() for r in caplog.records)
    )


@pytest.mark.mpi
def test_model_file_is_loaded_not_measured(tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    comm = MPI.COMM_WORLD
    path = comm.bcast(str(tmp_path_factory.mktemp("model") / "m.json") if comm.rank == 0 else None)
    if comm.rank == 0:
        FLAT.save(path)
    comm.Barrier()
    monkeypatch.setenv("MPIDL_COSTMODEL", path)
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail("re-measured"))
    sub = comm.Dup()
    try:
        for validate in (False, True):
            assert (
                collectives.explain(1 << 20, sub, validate=validate).predictions
                == costmodel.choose(
                    1 << 20, collectives.topology.layout.layout(sub), FLAT, validate=validate
                ).predictions
            )
    finally:
        sub.Free()


@pytest.mark.mpi
def test_device_calibration_measures_every_algorithms_latency(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrated on device buffers (here the fake CuPy's, through the staged transport),
    every message-passing algorithm's 8-byte latency is measured on that memory too: on a
    GPU-aware library a one-way step and an exchange differ by hundreds of microseconds
    (an H100 with Intel MPI: reduce_broadcast 0.47 ms, ring 1.1 ms on 2 ranks)."""
    import fake_cupy

    fake_cupy.install(monkeypatch)
    comm = MPI.COMM_WORLD
    prm = calibration.calibrate(comm, collectives.topology.layout.layout(comm, "1"), repeat=3, xp=fake_cupy)
    assert "device buffers" in prm.source
    passing = {name for name in costmodel.MODELS if name != "shm"}
    assert set(prm.offset) == (passing if comm.Get_size() > 1 else set())
    assert all(math.isfinite(v) for v in prm.offset.values())
