"""The timeline: a valid Chrome trace of every rank's steps, its phases in order (the
gradient before the step's communication, buckets inside it, steps one after another),
from the API around an algorithm and from ``mpidl train --timeline``, and its Gantt chart."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpitest import all_ok, comm_of_size, needs_torch, on_rank0_quietly
from test_train import train

import mpidl
from algorithms import SGD, AllReduceSGD, events

pytestmark = pytest.mark.mpi

METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def check_format(trace: dict[str, Any], ranks: int) -> list[dict[str, Any]]:
    """Assert that ``trace`` is Chrome trace JSON (object form) of ``ranks`` processes whose
    threads are all named; return its complete ("X") events."""
    assert json.loads(json.dumps(trace, allow_nan=False)) == trace
    assert isinstance(trace["traceEvents"], list) and trace["displayTimeUnit"] in ("ms", "ns")
    spans, named, processes = [], set(), set()
    for e in trace["traceEvents"]:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        assert isinstance(e["args"], dict) and e["ph"] in ("X", "M"), e
        if e["ph"] == "M":
            assert e["name"] in METADATA, e
            if e["name"] == "thread_name":
                assert isinstance(e["args"]["name"], str)
                named.add((e["pid"], e["tid"]))
            if e["name"] == "process_name":
                processes.add(e["pid"])
            continue
        assert isinstance(e["cat"], str) and isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["ts"] >= 0 and e["dur"] >= 0, e
        spans.append(e)
    assert processes == set(range(ranks)) and {e["pid"] for e in spans} == processes
    assert {(e["pid"], e["tid"]) for e in spans} <= named
    return spans


NS = 1e-3  # the trace's resolution in microseconds: a sum of two rounded times may exceed a third by less


def end(e: dict[str, Any]) -> float:
    return e["ts"] + e["dur"]


def before(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether span ``a`` ends before ``b`` starts."""
    return end(a) <= b["ts"] + NS


def inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["ts"] <= inner["ts"] + NS and end(inner) <= end(outer) + NS


def check_order(spans: list[dict[str, Any]], ranks: int, steps: int, buckets: int, overlap: bool = False) -> None:
    """On every rank: each step's gradient, then (``mpidl train``) its paced wait and its
    ``step()``, holding the communication, holding the buckets in order; the buckets of
    an overlapped step on the service thread, after its gradient started and before its
    wait for them ended; each step before the next."""
    for pid in range(ranks):
        mine = [e for e in spans if e["pid"] == pid and "step" in e["args"]]
        main = [e for e in mine if e["tid"] == 0]
        previous = None
        for k in range(steps):

            def one(name: str, k: int = k, among: list[dict[str, Any]] = main) -> dict[str, Any]:
                found = [e for e in among if e["name"] == name and e["args"]["step"] == k]
                assert len(found) == 1, (k, name, found)
                return found[0]

            compute = one("compute")
            comm = one("wait for buckets" if overlap else "communicate")
            assert before(compute, comm), (pid, k)
            if previous is not None:
                assert before(previous, compute), (pid, k)
            if any(e["name"] == "step" for e in main):  # mpidl train's
                step, paced = one("step"), one("paced")
                assert before(compute, paced) and before(paced, step) and inside(comm, step), (pid, k)
                previous = step
            else:
                previous = comm
            own = [e for e in mine if e["name"].startswith("bucket ") and e["args"]["step"] == k]
            assert [e["args"]["bucket"] for e in own] == list(range(buckets)), (pid, k, own)
            assert all(e["cat"] == events.COMMUNICATION and e["args"]["bytes"] > 0 for e in own)
            assert all(before(a, b) for a, b in zip(own, own[1:])), (pid, k)
            if overlap:
                assert all(e["tid"] != 0 and compute["ts"] <= e["ts"] + NS and end(e) <= end(comm) + NS for e in own)
            else:
                assert all(e["tid"] == 0 and inside(e, comm) for e in own), (pid, k)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "model", ["numpy", pytest.param("torch", marks=needs_torch), pytest.param("overlap", marks=needs_torch)]
)
def test_a_recorded_script_gives_each_rank_its_steps_in_order(model: str, tmp_path: Path) -> None:
    """Three steps of AllReduce-SGD in a script, the gradient marked with ``span``: a numpy
    model (one bucket), a torch MLP of three buckets, the same with overlap."""
    comm = comm_of_size(2)
    path = tmp_path / "trace.json"  # this process's own folder: rank 0 writes it
    rng = np.random.default_rng(comm.rank)
    if model == "numpy":
        x = np.zeros(40)
        algo = AllReduceSGD(x, SGD(x, lr=0.1), comm, collective="ring")

        def gradient() -> None:
            algo.optimizer.grad[:] = rng.standard_normal(40)
    else:
        import torch
        from test_overlap import SMALL_BUCKETS, loss, mlp

        net = mlp()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        algo = AllReduceSGD(net, opt, comm, collective="ring", bucket_mb=SMALL_BUCKETS, overlap=model == "overlap")

        def gradient() -> None:
            algo.zero_grad()
            loss(net, torch.randn(8, 5), torch.randint(0, 3, (8,))).backward()

    with algo, mpidl.timeline.record(str(path), comm) as recording:
        for k in range(3):
            with mpidl.timeline.span("compute", step=k):
                gradient()
            algo.step()
    assert events.active is None
    ok = True
    if comm.rank == 0:
        assert recording.trace is not None and json.loads(path.read_text()) == recording.trace
        spans = check_format(recording.trace, comm.size)
        check_order(spans, comm.size, 3, len(algo.buckets), overlap=model == "overlap")
        names = {e["args"]["name"] for e in recording.trace["traceEvents"] if e["name"] == "thread_name"}
        ok = (model == "overlap") == any(n.startswith("allreduce-buckets") for n in names)
    else:
        ok = recording.trace is None and not path.exists()
    assert all_ok(comm, ok)


def test_recording_off_records_nothing_and_an_error_drops_the_recording() -> None:
    comm = comm_of_size(1)
    x = np.zeros(4)
    with AllReduceSGD(x, SGD(x, lr=0.1), comm) as algo:
        algo.step(np.ones(4))
        assert events.active is None
        with pytest.raises(ZeroDivisionError), mpidl.timeline.record(None, comm):
            algo.step(np.ones(4))
            assert events.active is not None
            assert [span.name for span in events.active.spans] == ["bucket 0", "communicate"]
            1 / 0  # noqa: B018  # an error inside the block
        assert events.active is None
        with mpidl.timeline.record(None, comm) as recording:  # a new recording starts empty
            pass
    assert comm.rank != 0 or [e for e in recording.trace["traceEvents"] if e["ph"] == "X"] == []
    with pytest.raises(RuntimeError, match="no timeline is being recorded"):
        mpidl.timeline.stop()


@needs_torch
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="digits need scikit-learn")
def test_mpidl_train_writes_the_timeline_of_a_2_rank_3_step_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    """2 ranks x 3 steps (192 samples, batches of 32), a torch MLP of two buckets, paced:
    the trace holds each rank's gradient, paced wait and step, the buckets inside the
    step's communication, in order; the Gantt chart is a PNG."""
    out = tmp_path_factory.mktemp("train-timeline")
    plot = ["--timeline-plot", str(out / "gantt.png")] if importlib.util.find_spec("matplotlib") else []
    rc, _stdout, stderr = train(
        2,
        "--algorithm",
        "allreduce",
        "--collective",
        "ring",
        "--backend",
        "torch",
        "--overlap",
        "off",
        "--bucket-mb",
        "0.0005",
        "--step-time",
        "5ms",
        "--train-samples",
        "192",
        "--epochs",
        "1",
        "--hidden",
        "16",
        "--no-progress",
        "--timeline",
        str(out / "trace.json"),
        *plot,
    )
    assert rc == 0, stderr
    trace = on_rank0_quietly(lambda: json.loads((out / "trace.json").read_text()))
    spans = check_format(trace, 2)
    check_order(spans, 2, 3, 2)
    assert [e["args"]["epoch"] for e in spans if e["name"] == "evaluate"] == [1, 1]
    if plot:
        assert on_rank0_quietly(lambda: (out / "gantt.png").read_bytes()[:8]) == b"\x89PNG\r\n\x1a\n"


def test_the_gantt_chart_refuses_a_trace_without_steps(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    trace = {
        "traceEvents": [{"name": "x", "cat": "compute", "ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 0, "args": {}}]
    }
    with pytest.raises(ValueError, match="no step of rank 0's main thread"):
        mpidl.timeline.plot(trace, str(tmp_path / "g.png"))
