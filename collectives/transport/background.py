"""A service thread that runs communication while the caller computes.

What overlaps communication with computation hands a task to a
:class:`Background` (LSGD's inter-group all-reduce, AD-PSGD's averagings,
AllReduce-SGD's and D-PSGD's overlapped buckets and averages, the
nonblocking all-reduce of :mod:`collectives.nonblocking`). Tasks run one at a
time, in the order submitted, on one thread, so a task may own a communicator
that no other thread uses (MPI must provide ``MPI_THREAD_MULTIPLE``, mpi4py's
default: callers check it first, :func:`collectives.transport.threads.require_multiple`).

Each task is a :class:`Task`: its value, the payload bytes it sent
(:func:`collectives.transport.p2p.bytes_sent` counts per thread) or its
exception, once done. :meth:`Background.submit` queues a task whose result the
caller takes in order with :meth:`Background.result`; :meth:`Background.launch`
one that the caller holds and waits for itself, in any order. A task's
exception is raised by whoever takes its result, or by :meth:`Background.close`
where it drops a submitted task's result: it never goes unseen.

A thread whose tasks touch device buffers makes their device current when it
starts (``device``; :func:`collectives.transport.gpu.use_device`). The
thread's waits poll (:func:`collectives.transport.p2p.poll_waits`): a
blocking MPI wait busy-waits on a core the computation needs.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any, Callable

from . import threads
from .gpu import use_device
from .p2p import bytes_sent, poll_waits

_STOP = object()


class Task:
    """A task given to a :class:`Background`: once :meth:`done`, its value and the payload
    bytes it sent, or its exception."""

    __slots__ = ("_done", "_error", "_nbytes", "_value", "fn")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self._done = threading.Event()
        self._value: Any = None
        self._nbytes = 0
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the task has finished (without waiting)."""
        return self._done.is_set()

    def wait(self) -> tuple[Any, int]:
        """Wait until the task has finished; return (its value, payload bytes it sent).

        Re-raises the task's exception, if any (every time).
        """
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value, self._nbytes

    def _run(self, failed: BaseException | None) -> None:
        before = bytes_sent()
        try:
            if failed is not None:
                raise failed
            self._value = self.fn()
        except BaseException as exc:  # handed to whoever waits for the task
            self._error = exc
        self._nbytes = bytes_sent() - before
        self._done.set()


class Background:
    """One daemon thread running submitted tasks in order, with CUDA device ``device``
    current (:func:`collectives.transport.gpu.device_of` the buffers the tasks touch;
    None for host buffers)."""

    def __init__(self, name: str, device: int | None = None) -> None:
        self._tasks: queue.Queue = queue.Queue()
        self._unclaimed: deque[Task] = deque()  # submitted, their results not taken yet
        self._thread = threads.start(self._run, name, device)

    @property
    def pending(self) -> int:
        """Submitted tasks whose results were not taken yet (launched ones not counted)."""
        return len(self._unclaimed)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)``, its result to be taken by :meth:`result`; its
        arguments must not be touched until then."""
        self._unclaimed.append(self.launch(fn, *args, **kwargs))

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Task:
        """Queue ``fn(*args, **kwargs)`` and return its :class:`Task`, whose ``wait()``
        gives its result; its arguments must not be touched until the task is done."""
        task = Task(lambda: fn(*args, **kwargs))
        self._tasks.put(task)
        return task

    def result(self) -> tuple[Any, int]:
        """Wait for the oldest submitted task whose result was not taken; return (its
        value, payload bytes it sent).

        Re-raises the task's exception, if any.
        """
        if not self._unclaimed:
            raise RuntimeError("no task submitted")
        return self._unclaimed.popleft().wait()

    def close(self) -> None:
        """Finish the queued tasks and stop the thread; the results of the submitted
        ones are dropped, but the first exception among them is raised (no one else
        would see it). Launched tasks keep theirs for their holders."""
        self._tasks.put(_STOP)
        self._thread.join()
        dropped, self._unclaimed = self._unclaimed, deque()
        failure = next((task._error for task in dropped if task._error is not None), None)
        if failure is not None:
            raise failure

    def _run(self, device: int | None) -> None:
        failed: BaseException | None = None
        poll_waits()
        try:
            use_device(device)
        except BaseException as exc:  # every task fails with it: waiting for one raises, never hangs
            failed = exc
        while True:
            task = self._tasks.get()
            if task is _STOP:
                return
            task._run(failed)
