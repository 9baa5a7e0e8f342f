"""A service thread that runs communication while the caller computes.

Algorithms that overlap communication with computation (LSGD's inter-group
all-reduce, AD-PSGD's averagings) hand a task to a :class:`Background`
and collect its result on a later step. Tasks run one at a time, in the order
submitted, on one thread, so a task may own a communicator that no other
thread uses (MPI must provide ``MPI_THREAD_MULTIPLE``, mpi4py's default:
the algorithms check it first, :func:`collectives.transport.threads.require_multiple`).
Each result carries the payload bytes the task sent
(:func:`collectives.transport.p2p.bytes_sent` counts per thread). A thread
whose tasks touch device buffers makes their device current when it starts
(``device``; :func:`collectives.transport.gpu.use_device`). The thread's
waits poll (:func:`collectives.transport.p2p.poll_waits`): a blocking MPI
wait busy-waits on a core the computation needs. A task's exception is
raised by :meth:`Background.result`, or by :meth:`Background.close` where
it drops the task's result: it never goes unseen.
"""

from __future__ import annotations

import os
import queue
import sys
from typing import Any, Callable

from mpi4py import MPI

from collectives.topology.layout import detected
from collectives.transport import threads
from collectives.transport.context import context
from collectives.transport.gpu import use_device
from collectives.transport.p2p import bytes_sent, poll_waits

_STOP = object()


class Background:
    """One daemon thread running submitted tasks in order, with CUDA device ``device``
    current (:func:`collectives.transport.gpu.device_of` the buffers the tasks touch;
    None for host buffers)."""

    def __init__(self, name: str, device: int | None = None) -> None:
        self._tasks: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self.pending = 0
        self._thread = threads.start(self._run, name, device)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)``; its arguments must not be touched until its result is taken."""
        self.pending += 1
        self._tasks.put((fn, args, kwargs))

    def result(self) -> tuple[Any, int]:
        """Wait for the oldest unclaimed task; return (its value, payload bytes it sent).

        Re-raises the task's exception, if any.
        """
        if not self.pending:
            raise RuntimeError("no task submitted")
        self.pending -= 1
        value, nbytes, error = self._results.get()
        if error is not None:
            raise error
        return value, nbytes

    def close(self) -> None:
        """Finish the queued tasks and stop the thread; their results are dropped,
        but the first exception among them is raised (no one else would see it)."""
        self._tasks.put(_STOP)
        self._thread.join()
        self.pending = 0
        dropped = [self._results.get_nowait() for _ in range(self._results.qsize())]
        failure = next((error for _, _, error in dropped if error is not None), None)
        if failure is not None:
            raise failure

    def _run(self, device: int | None) -> None:
        failed: BaseException | None = None
        poll_waits()
        try:
            use_device(device)
        except BaseException as exc:  # every task fails with it: result() raises, never waits
            failed = exc
        while True:
            task = self._tasks.get()
            if task is _STOP:
                return
            fn, args, kwargs = task
            before = bytes_sent()
            try:
                if failed is not None:
                    raise failed
                self._results.put((fn(*args, **kwargs), bytes_sent() - before, None))
            except BaseException as exc:  # handed to the caller by result()
                self._results.put((None, bytes_sent() - before, exc))


def spare_cores(comm: MPI.Comm, wanted: bool = True) -> bool:
    """Whether every rank of ``comm`` wants a service thread and has a core for it
    besides its computation (collective): on each node, the cores a process may run on
    are at least the node's ranks times (torch's intra-op threads + 1). Where they are
    not, the thread's work takes cores from the computation, so overlapping it with the
    computation hides nothing."""
    ctx = context(comm)
    node_of = detected(ctx).node_of
    ranks_here = node_of.count(node_of[ctx.rank])
    torch = sys.modules.get("torch")
    intra_op = torch.get_num_threads() if torch is not None else 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return bool(ctx.comm.allreduce(wanted and cores >= ranks_here * (intra_op + 1), op=MPI.LAND))
