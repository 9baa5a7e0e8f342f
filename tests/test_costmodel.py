"""The cost model's formulas, calibration, persistence and automatic choice."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, mpiexec, on_rank0_quietly

import collectives
from collectives.topology.layout import Layout
from collectives.transport.context import context
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
    small = 4096  # up to LEADERS_DOUBLING the leaders exchange whole vectors, lg m times
    doubling = 10 * A + small * 10 * B + small * G
    assert costmodel.shm(prm, Layout((0, 1, 2, 3)), small) == pytest.approx(2 * doubling)


def test_check_costs_nothing_where_it_rides_along() -> None:
    from collectives.validation import FUSE_LIMIT

    prm = Params(
        alpha_intra=A, beta_intra=B, alpha_inter=10 * A, beta_inter=10 * B, gamma=G, overhead=0.0, alpha_shm=A / 3
    )
    node, singles, nodes = one_node(4), Layout((0, 1, 2, 3, 4)), Layout((0, 0, 1, 1, 2))
    assert costmodel.check_cost("shm", N, node, prm) == 0.0
    assert costmodel.check_cost("ring", N, node, prm) == pytest.approx(A / 3)  # one shared-memory barrier
    header_exchange = 10 * A + 2 * 48 * 10 * B
    # one rank per node: a recursive doubling over all ranks, in which small butterflies ride
    assert costmodel.check_cost("butterfly", FUSE_LIMIT, singles, prm) == 0.0
    assert costmodel.check_cost("butterfly", FUSE_LIMIT + 1, singles, prm) == pytest.approx(3 * header_exchange)
    assert costmodel.check_cost("shm", 64, singles, prm) == pytest.approx(3 * header_exchange)
    # nodes of several ranks: the node stages (two barriers) around the leaders' doubling, with small shm,
    # which the calibration times unchecked with the same doubling among the leaders
    assert collectives.kernels.shm.LEADERS_DOUBLING == FUSE_LIMIT
    assert costmodel.check_cost("shm", FUSE_LIMIT, nodes, prm) == 0.0
    assert costmodel.check_cost("shm", FUSE_LIMIT + 1, nodes, prm) == pytest.approx(2 * header_exchange + 2 * A / 3)
    assert costmodel.check_cost("butterfly", 64, nodes, prm) == pytest.approx(2 * header_exchange + 2 * A / 3)
    # across nodes, the MPI library's all-reduce carries it up to the fused limit (repeated calls)
    for lay, bare in ((singles, 3 * header_exchange), (nodes, 2 * header_exchange + 2 * A / 3)):
        assert costmodel.check_cost("mpi", FUSE_LIMIT, lay, prm) == 0.0
        assert costmodel.check_cost("mpi", FUSE_LIMIT + 1, lay, prm) == pytest.approx(bare)
    assert costmodel.check_cost("mpi", 64, node, prm) == pytest.approx(A / 3)
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
        entry=lambda: collectives.allreduce(empty, comm, collective="ring", validate=False),
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
    assert choice.algorithm in collectives.COLLECTIVES and choice.predictions[choice.algorithm] == min(
        choice.predictions.values()
    )
    with caplog.at_level(logging.DEBUG, logger="collectives.auto"):
        x = np.ones(12345, np.float32)
        collectives.allreduce(x, comm, collective="auto")
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


def shared_path(tmp_path_factory: pytest.TempPathFactory, name: str) -> str:
    """A path in rank 0's temporary directory, the same on every rank."""
    comm = MPI.COMM_WORLD
    return comm.bcast(str(tmp_path_factory.mktemp("model") / name) if comm.rank == 0 else None)


MEASURED = dataclasses.replace(FLAT, alpha_shm=7e-6, source="measured here")


def params_on_fresh_comm(monkeypatch: pytest.MonkeyPatch, path: str) -> Params:
    """The host parameters of a new communicator with ``MPIDL_COSTMODEL=path`` on this
    rank, a calibration standing in as :data:`MEASURED` (no communication)."""
    monkeypatch.setenv("MPIDL_COSTMODEL", path)
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: dataclasses.replace(MEASURED))
    sub = MPI.COMM_WORLD.Dup()
    try:
        return collectives.cost_params(sub)
    finally:
        sub.Free()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_model_file_on_some_nodes_only_is_used_by_all(tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node-local path: the file exists where rank 0 runs, not elsewhere (here: other
    ranks name a missing file). Every rank must use rank 0's file: ranks that
    measured instead chose other algorithms and hung."""
    comm = MPI.COMM_WORLD
    path = shared_path(tmp_path_factory, "m.json")
    if comm.rank == 0:
        FLAT.save(path)
    comm.Barrier()
    prm = params_on_fresh_comm(monkeypatch, path if comm.rank == 0 else path + ".elsewhere")
    assert all_ok(comm, prm == FLAT), prm


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_model_file_written_once_measured(tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    comm = MPI.COMM_WORLD
    path = shared_path(tmp_path_factory, "new.json")
    prm = params_on_fresh_comm(monkeypatch, path)
    assert all_ok(comm, prm == MEASURED and Params.load(path) == MEASURED)
    assert all_ok(comm, os.listdir(os.path.dirname(path)) == ["new.json"])  # no temporary file left


BAD_FILES = [
    ("{not json", "not valid JSON"),
    ('{"alpha_intra": "5e-6"}', "'alpha_intra' is '5e-6', not a finite number"),
    ('{"beta_shm": NaN}', "'beta_shm' is nan, not a finite number"),
    ('{"gamma": true}', "'gamma' is True, not a finite number"),
    ("[1e-6, 2e-10]", "holds a JSON list, not an object of parameters"),
    ('{"alpha": 1e-6}', "unknown parameter 'alpha'"),
    ('{"offset": {"auto": 1e-6}}', "'offset' names 'auto', not an algorithm"),
    ('{"offset": {"ring": "fast"}}', "offset 'ring' is 'fast', not a finite number"),
    ('{"offset": [1e-6]}', "'offset' is [1e-06], not an object"),
    ('{"source": 3}', "'source' is 3, not text"),
    ("", "not valid JSON"),
]


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("text", "problem"), BAD_FILES)
def test_bad_model_file_raises_on_every_rank(
    text: str, problem: str, tmp_path_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that holds no valid parameters: the same ArgumentError naming the file and
    the problem on every rank (it raised a raw error on each rank, or loaded a string
    that failed later, or loaded silently)."""
    comm = MPI.COMM_WORLD
    path = shared_path(tmp_path_factory, "bad.json")
    if comm.rank == 0:
        with open(path, "w") as f:
            f.write(text)
    comm.Barrier()
    with pytest.raises(collectives.ArgumentError) as info:
        params_on_fresh_comm(monkeypatch, path)
    message = str(info.value)
    assert all_ok(comm, len(set(comm.allgather(message))) == 1), message
    assert f"MPIDL_COSTMODEL={path}" in message and problem in message, message


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_unusable_model_path_raises_on_every_rank(tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory, and a file in a directory that does not exist (it cannot be written)."""
    comm = MPI.COMM_WORLD
    directory = shared_path(tmp_path_factory, "")
    for path, problem in ((directory, "cannot use this cost-model file"), (directory + "/no/m.json", "cannot write")):
        with pytest.raises(collectives.ArgumentError) as info:
            params_on_fresh_comm(monkeypatch, path)
        message = str(info.value)
        assert all_ok(comm, len(set(comm.allgather(message))) == 1), message
        assert f"MPIDL_COSTMODEL={path}" in message and problem in message, message


def test_model_file_replaced_whole_or_not_at_all(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer interrupted half-way leaves the old file as it was, and no temporary file
    (the file was opened for writing in place: a reader saw it empty or cut short)."""
    path = tmp_path / "m.json"
    FLAT.save(str(path))
    before = path.read_text()

    def half(obj, f, **kwargs):
        f.write(json.dumps(obj)[:20])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(costmodel.json, "dump", half)
    with pytest.raises(OSError, match="No space"):
        MEASURED.save(str(path))
    assert path.read_text() == before and os.listdir(tmp_path) == ["m.json"]


def test_auto_names_its_choice_for_the_stall_inspector() -> None:
    """A stall report names the algorithm auto chose, not just "auto" (without online
    tuning, whose first calls run its candidates: a calibration that a busy machine
    measured slow enough to tune at 800 bytes once left this first call unnamed)."""
    comm = MPI.COMM_WORLD
    x = np.ones(100)
    previous = collectives.set_tuning(online=False)
    try:
        collectives.allreduce(x, comm)
    finally:
        collectives.set_tuning(**dataclasses.asdict(previous))
    names = {call.operation for call in context(comm).calls.values() if call.algorithm == "auto"}
    named = {f"allreduce(collective='auto': {name!r})" for name in collectives.COLLECTIVES if name != "auto"}
    assert names & named, names


#: Rank 1 comes late to a calibration on a new communicator, rank 0 to the cost
#: model's file, rank 1 to a calibration on a communicator in use.
LATE_TO_CALIBRATION = """
import time
from mpi4py import MPI
from collectives.topology.layout import layout
from collectives.tuning import calibration
comm = MPI.COMM_WORLD.Dup()
lay = layout(comm, str(comm.size))
for step in range(3):
    if comm.rank == (0 if step == 1 else 1):
        time.sleep(2)
    if step == 1:
        calibration.params_for(comm, lay, {})
    else:
        calibration.calibrate(comm, lay, repeat=1)
"""


@pytest.mark.job
@pytest.mark.mpi
def test_calibration_waits_are_watched(tmp_path_factory) -> None:
    """The calibration's collective waits (the file's verdict, Barrier, Allreduce, a
    plan's communicators) are shown to the stall inspector: a rank that comes late
    is reported, the operation named (they were not seen at all)."""
    path = shared_path(tmp_path_factory, "m.json")
    if MPI.COMM_WORLD.rank == 0:
        FLAT.save(path)
    env = {"MPIDL_STALL_WARN": "0.5", "MPIDL_STALL_ABORT": "0", "MPIDL_COSTMODEL": path}
    run = on_rank0_quietly(mpiexec, 2, ["-c", LATE_TO_CALIBRATION], timeout=60, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    for late, what in (
        (1, r"the set-up of the collectives on a communicator \(MPI_Comm_dup at its first collective call\)"),
        (0, r"the cost model's calibration \(the cost-model file\)"),
        (1, r"the cost model's calibration \(Barrier\)"),
    ):
        waited = rf"rank {1 - late}: MainThread has waited \d+ s in {what} for rank\(s\) {late} "
        assert re.search(waited, run.stderr), run.stderr[-3000:]


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
