"""A timeline of training: every rank's computation, communication and waiting, per step.

From the command line (``--timeline-plot`` draws a Gantt chart of a few steps)::

    mpiexec -n 2 mpidl train --algorithm allreduce --timeline trace.json --timeline-plot trace.png

In a script, around the steps of any :class:`algorithms.Algorithm`::

    with mpidl.timeline.record("trace.json"):
        for step, (x, y) in enumerate(batches):
            with mpidl.timeline.span("compute", step=step):
                algo.zero_grad()
                loss_fn(model(x), y).backward()
            algo.step()

What is recorded (:mod:`algorithms.events`): the algorithms' communication
(``communicate``), their waits for a service thread (``wait for buckets``,
``wait for averaging``), every AllReduce-SGD bucket's all-reduce (``bucket
K``, on the thread that runs it: the caller's, or the service thread's with
overlap) and AD-PSGD's averagings on their thread; ``mpidl train`` adds each
step's gradient (``compute``), the wait of a paced or slowed step (``paced``,
with its slowdown ``factor``), the whole ``step()``, and the ``settle`` and
``evaluate`` between epochs; a script adds what it marks with :func:`span`.
Every span carries the worker's ``step`` (counted from 0); buckets their
size in ``bytes`` and their all-reduce ``collective``.

The file is Chrome's Trace Event Format (the JSON object form), which
Perfetto (https://ui.perfetto.dev) and ``chrome://tracing`` open, as
Horovod's timeline is: a complete event (``"ph": "X"``) per span, with
``ts`` and ``dur`` in microseconds since the recording started, ``pid`` the
rank and ``tid`` the thread (0 the main thread, then the service threads in
the order they first recorded), ``cat`` its category (``compute``,
``paced``, ``step``, ``communication``, ``wait``, ``eval``) and ``args``;
metadata events (``"ph": "M"``) name the processes (``rank R (HOST)``) and
threads and keep them in rank order. Spans of one thread nest (a bucket
inside its step's ``communicate``, that inside ``step``).

Clocks: each rank reads its own :func:`time.perf_counter`; :func:`start`
leaves a barrier on every rank and takes that moment as time 0, so ranks
line up to within the barrier's skew (microseconds on a node, a latency or
two across nodes). Spans stay in each process's memory (about 100 bytes each,
a few per step and bucket) until :func:`stop` gathers them to rank 0, which
writes the file. Off, recording costs a check of a flag per span.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from mpi4py import MPI

from algorithms import events

from . import plotting

#: The categories in the order the Gantt chart's legend lists them, with their colours.
COLOURS = {
    events.COMPUTE: "#4c72b0",
    events.PACED: "#a1c4e6",
    events.STEP: "#e0e0e0",
    events.COMMUNICATION: "#dd8452",
    events.WAIT: "#c44e52",
    events.EVALUATION: "#8c8c8c",
}

_NS = 1e-3  # microseconds: ends and starts closer than this touch (the trace rounds to it)

_session: tuple[MPI.Comm, float] | None = None  # the communicator and this rank's time 0, while recording


def start(comm: MPI.Comm | None = None) -> None:
    """Start recording every rank's spans (collective over ``comm``, default ``MPI.COMM_WORLD``).

    Raises:
        RuntimeError: a timeline is being recorded already.
    """
    global _session
    if _session is not None:
        raise RuntimeError("a timeline is being recorded already: stop() it first")
    comm = MPI.COMM_WORLD if comm is None else comm
    comm.Barrier()
    origin = time.perf_counter()
    events.start()
    _session = (comm, origin)


def stop(path: str | None = None) -> dict[str, Any] | None:
    """Stop recording, gather every rank's spans to rank 0 and build the trace
    (collective over :func:`start`'s communicator); rank 0 writes it to ``path``
    if given. Returns the trace (a dict of the Chrome format) on rank 0, None elsewhere.

    Raises:
        RuntimeError: no timeline is being recorded.
    """
    global _session
    if _session is None:
        raise RuntimeError("no timeline is being recorded: start() one first")
    comm, origin = _session
    _session = None
    recorder = events.stop()
    mine = _local(recorder, origin)
    gathered = comm.gather(mine, root=0)
    if gathered is None:
        return None
    result = trace(gathered)
    if path is not None:
        write(result, path)
    return result


def abandon() -> None:
    """Stop recording on this rank alone and drop what it recorded (after an error on
    the way to :func:`stop`); nothing if no timeline is being recorded."""
    global _session
    if _session is not None:
        _session = None
        events.stop()


class Recording:
    """What :func:`record` yields: after the block, ``trace`` holds the trace on rank 0
    (None elsewhere, and before the block ends)."""

    trace: dict[str, Any] | None = None


@contextmanager
def record(path: str | None = None, comm: MPI.Comm | None = None) -> Iterator[Recording]:
    """Record the enclosed block's timeline (collective over ``comm``) and write it to
    ``path`` on rank 0; the :class:`Recording` yielded holds it afterwards. An exception
    leaving the block drops the recording on this rank without waiting for the others
    (it may be this rank's alone)."""
    recording = Recording()
    start(comm)
    try:
        yield recording
    except BaseException:
        abandon()
        raise
    recording.trace = stop(path)


def span(name: str, category: str = events.COMPUTE, **args: Any) -> AbstractContextManager[None]:
    """Record the enclosed block as a span of the calling thread while a timeline is
    recorded (e.g. ``span("compute", step=k)`` around a forward and backward pass);
    ``category`` colours it (module docstring)."""
    return events.span(name, category, **args)


def _local(recorder: events.Recorder, origin: float) -> dict[str, Any]:
    """This rank's spans in microseconds since ``origin``, its threads numbered
    (0 the main thread, then in order of their first span), and its host."""
    main = threading.main_thread().ident
    assert main is not None  # the main thread has started
    order = [main] + [t for t in dict.fromkeys(s.thread for s in recorder.spans) if t != main]
    tid = {t: i for i, t in enumerate(order)}
    names = {tid[t]: ("main" if t == main else recorder.threads.get(t, f"thread {tid[t]}")) for t in order}
    spans = [
        (s.name, s.category, (s.start - origin) * 1e6, (s.end - origin) * 1e6, tid[s.thread], s.args)
        for s in recorder.spans
    ]
    return {"host": MPI.Get_processor_name(), "threads": names, "spans": spans}


def trace(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome trace (module docstring) of every rank's :func:`_local` record, in rank order."""
    out: list[dict[str, Any]] = []
    for pid, rank in enumerate(ranks):
        out.append(_meta("process_name", pid, 0, name=f"rank {pid} ({rank['host']})"))
        out.append(_meta("process_sort_index", pid, 0, sort_index=pid))
        for tid, name in sorted(rank["threads"].items()):
            out.append(_meta("thread_name", pid, tid, name=name))
            out.append(_meta("thread_sort_index", pid, tid, sort_index=tid))
        spans = sorted(rank["spans"], key=lambda s: (s[4], s[2], -s[3]))  # by thread, start, outer first
        for name, category, t0, t1, tid, args in spans:
            ts, end = round(t0, 3), round(t1, 3)
            out.append(
                {
                    "name": name,
                    "cat": category,
                    "ph": "X",
                    "ts": ts,
                    "dur": round(end - ts, 3),
                    "pid": pid,
                    "tid": tid,
                    "args": args,
                }
            )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write(result: dict[str, Any], path: str) -> None:
    """Write a trace to ``path`` as JSON."""
    with open(path, "w") as f:
        json.dump(result, f, separators=(",", ":"))


def read(path: str) -> dict[str, Any]:
    """Read a trace written by :func:`write`."""
    with open(path) as f:
        result: dict[str, Any] = json.load(f)
    return result


def plot(result: dict[str, Any], path: str, first: int = 1, steps: int = 3, title: str = "timeline") -> None:
    """Draw a Gantt chart of a trace to ``path`` (PNG; needs matplotlib): a row per rank
    and thread, a bar per span coloured by category, nested spans thinner inside
    their parent, over the time rank 0's main thread took for its steps ``first`` to
    ``first + steps - 1`` (its first ``steps`` steps, where it recorded none of those);
    ``title`` heads it, followed by the steps.

    Raises:
        ValueError: the trace holds no step of rank 0's main thread.
    """
    spans = [e for e in result["traceEvents"] if e["ph"] == "X"]
    own = sorted({e["args"]["step"] for e in spans if e["pid"] == 0 and e["tid"] == 0 and "step" in e["args"]})
    if not own:
        raise ValueError("the timeline holds no step of rank 0's main thread to draw")
    chosen = [s for s in own if first <= s < first + steps] or own[:steps]
    window = [e for e in spans if e["pid"] == 0 and e["tid"] == 0 and e["args"].get("step") in chosen]
    lo, hi = min(e["ts"] for e in window), max(e["ts"] + e["dur"] for e in window)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in result["traceEvents"] if e["name"] == "thread_name"}
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    plt = plotting.pyplot()
    from matplotlib.colors import to_rgb

    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.45 * len(rows)), layout="constrained")
    used: set[str] = set()
    for y, row in enumerate(rows):
        stack: list[float] = []  # ends of the enclosing spans
        for e in sorted((e for e in spans if (e["pid"], e["tid"]) == row), key=lambda e: (e["ts"], -e["dur"])):
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"] + _NS:
                stack.pop()
            depth = len(stack)
            stack.append(end)
            if end < lo or e["ts"] > hi:
                continue
            height = max(0.8 - 0.2 * depth, 0.2)
            shade = 0.8 ** max(depth - 1, 0)  # a span inside one of its own colour is darker
            colour = tuple(c * shade for c in to_rgb(COLOURS.get(e["cat"], "#55a868")))
            ax.broken_barh(
                [((e["ts"] - lo) / 1e3, e["dur"] / 1e3)],
                (y - height / 2, height),
                facecolors=colour,
                edgecolors="white",
                linewidth=0.5,
                label=None if e["cat"] in used else e["cat"],
            )
            used.add(e["cat"])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p}" + ("" if t == 0 else f" {names.get((p, t), t)}") for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel(f"time (ms) from the start of rank 0's step {chosen[0]}")
    handles, labels = ax.get_legend_handles_labels()
    order = [labels.index(c) for c in COLOURS if c in labels]
    fig.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8, ncol=6, loc="outside lower center")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title(f"{title}: steps {chosen[0]}-{chosen[-1]}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["COLOURS", "Recording", "abandon", "plot", "read", "record", "span", "start", "stop", "trace", "write"]
