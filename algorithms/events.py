"""Spans of a training step for a timeline: what each thread of a worker did, when.

While a :class:`Recorder` is on (:func:`start`), the algorithms record their
communication as spans of wall time, each with a name, a category and the
step it belongs to: :meth:`Algorithm._communicating
<algorithms.base.Algorithm._communicating>` records the step's communication
(``communicate``: communicating, which includes waiting for the peers to
arrive) or the wait for another thread's (``wait``: AllReduce-SGD waiting for
the buckets in flight on its service thread), and AllReduce-SGD each
bucket's all-reduce (``bucket K``) on the thread that runs it. A training
loop adds its own spans (``mpidl train``: the gradient, the paced or slowed
wait, the whole ``step()``; a user's script: :func:`span`). The face
(:mod:`mpidl.timeline`) gathers them to rank 0 and writes a Chrome trace.

Off (the default), recording costs one check of a module global per
span (``active is None``); on, a few microseconds per span (a clock read, a
tuple appended to a list, which is atomic under the GIL, so service threads
append without a lock). Spans are kept in memory until :func:`stop`: about
100 bytes each, a few per step and bucket.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

#: The categories of spans, as the Chrome trace and the Gantt chart colour them.
COMPUTE, PACED, STEP, COMMUNICATION, WAIT, EVALUATION = "compute", "paced", "step", "communication", "wait", "eval"


class Span(NamedTuple):
    """One span of one thread: ``start`` and ``end`` in :func:`time.perf_counter` seconds."""

    name: str
    category: str
    start: float
    end: float
    thread: int
    args: dict[str, Any]


class Recorder:
    """The spans of this process since it was started, and the names of its threads."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.threads: dict[int, str] = {}

    def add(self, name: str, category: str, start: float, end: float, **args: Any) -> None:
        """Record a span of the calling thread."""
        ident = threading.get_ident()
        if ident not in self.threads:
            self.threads[ident] = threading.current_thread().name
        self.spans.append(Span(name, category, start, end, ident, args))


#: The recorder, while one is on; None otherwise (checked by every place that records).
active: Recorder | None = None


def start() -> Recorder:
    """Start recording in this process (a new, empty recorder); returns it."""
    global active
    if active is not None:
        raise RuntimeError("a timeline is already being recorded")
    active = Recorder()
    return active


def stop() -> Recorder:
    """Stop recording; returns the recorder with what it holds."""
    global active
    if active is None:
        raise RuntimeError("no timeline is being recorded")
    recorder, active = active, None
    return recorder


@contextmanager
def span(name: str, category: str, **args: Any) -> Iterator[None]:
    """Record the enclosed block as a span of the calling thread, if recording."""
    recorder = active
    if recorder is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        recorder.add(name, category, t0, time.perf_counter(), **args)


__all__ = [
    "COMMUNICATION",
    "COMPUTE",
    "EVALUATION",
    "PACED",
    "STEP",
    "WAIT",
    "Recorder",
    "Span",
    "active",
    "span",
    "start",
    "stop",
]
