"""The nonblocking all-reduce: start it, compute, then wait for it.

:func:`allreduce_async` queues an all-reduce on a service thread and returns
at once with a :class:`Handle`; ``handle.wait()`` (or :func:`synchronize`)
returns the reduced buffer, ``handle.test()`` says whether it is done, as
Horovod's ``allreduce_async_``, ``poll`` and ``synchronize`` do.

Phases: the call queues the task (no communication, a few microseconds); the
communicator's service thread (:class:`~collectives.transport.background.Background`,
one per communicator, started with a private duplicate of it at the first
call, collectively) runs the queued all-reduces one at a time in the order
they were issued, each as :func:`collectives.allreduce` runs it — the
argument check across ranks, then the algorithm — while the caller computes;
``wait()`` blocks until its task is done. The thread's waits poll
(:func:`collectives.transport.p2p.poll_waits`), leaving the cores to the
computation: an algorithm that moves data through messages waits on the
network while the caller computes; one that copies and combines in memory
(``shm``) needs a core of its own to overlap.

Cost: that of the synchronous all-reduce, on the service thread, plus handing
the task over. Order: every rank must issue its nonblocking all-reduces on a
communicator in the same order (Horovod matches them by name; here the order
is the name), as with MPI's nonblocking collectives; they run on their own
communicator, so synchronous collectives on the same communicator may come
between them in any order. Errors: bad or disagreeing arguments raise the
same :class:`~collectives.errors.ArgumentError` on every rank from ``wait()``,
with the buffer untouched (with validation on, the default).
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from .api import DEFAULT_COLLECTIVE, allreduce
from .topology.layout import RanksPerNode
from .transport import p2p, threads
from .transport.background import Background, Task
from .transport.context import context
from .transport.gpu import device_of, use_device

_WORLD = MPI.COMM_WORLD
_SERVICE = "allreduce_async"  # the key of a communicator's service in its context's cache


class Handle:
    """An all-reduce in flight (:func:`allreduce_async`)."""

    __slots__ = ("_buf", "_task")

    def __init__(self, task: Task, buf: Any) -> None:
        self._task, self._buf = task, buf

    def test(self) -> bool:
        """Whether the all-reduce is done (then :meth:`wait` returns at once); never blocks."""
        return self._task.done()

    def wait(self) -> Any:
        """Wait until the all-reduce is done and return the buffer, reduced.

        Raises:
            ArgumentError: bad or disagreeing arguments, on every rank, with the
                buffer untouched; or whatever the all-reduce raised.
        """
        self._task.wait()
        return self._buf


def allreduce_async(
    buf: Any,
    comm: MPI.Comm | None = None,
    op: str = "sum",
    collective: str = DEFAULT_COLLECTIVE,
    *,
    validate: bool | None = None,
    layout: RanksPerNode = None,
    grid: tuple[int, int] | None = None,
) -> Handle:
    """Start reducing ``buf`` in place across ``comm``, as :func:`collectives.allreduce`
    with the same arguments does, on a service thread; return its :class:`Handle`.

    ``buf`` must be neither read nor written until the handle's ``wait()`` (or
    ``test()`` returning True): the service thread reads and overwrites it
    meanwhile. Collective: every rank of ``comm`` issues the same nonblocking
    all-reduces in the same order (module docstring). The first call on a
    communicator starts its service thread (collective: a duplicate of ``comm``).

    Raises:
        ArgumentError: MPI does not provide ``MPI_THREAD_MULTIPLE`` (raised here,
            on every rank). Argument errors are raised by ``wait()``.
    """
    user = _WORLD if comm is None else comm
    service = _service(user)
    task = service.thread.launch(service.reduce, buf, op, collective, validate, layout, grid)
    return Handle(task, buf)


def synchronize(handle: Handle) -> Any:
    """``handle.wait()``: the reduced buffer, once the all-reduce is done (Horovod's name)."""
    return handle.wait()


class _Service:
    """A communicator's nonblocking all-reduces: a private duplicate and the thread that
    runs them on it, freed with the communicator (:mod:`collectives.transport.context`)."""

    def __init__(self, comm: MPI.Comm) -> None:
        threads.require_multiple("allreduce_async runs the all-reduce on a service thread")
        p2p.operation("the set-up of allreduce_async on a communicator (MPI_Comm_dup at its first call)")
        with p2p.waiting(comm):
            self.comm = comm.Dup()
        self.thread = Background(f"allreduce-async-rank{comm.Get_rank()}")

    def reduce(
        self,
        buf: Any,
        op: str,
        collective: str,
        validate: bool | None,
        layout: RanksPerNode,
        grid: tuple[int, int] | None,
    ) -> None:
        """One task: the all-reduce on the private communicator, with ``buf``'s device current."""
        use_device(device_of(buf))
        allreduce(buf, self.comm, op, collective, validate=validate, layout=layout, grid=grid)

    def free(self) -> None:
        """Finish the queued all-reduces, stop the thread, free the communicator."""
        self.thread.close()
        if not MPI.Is_finalized():
            self.comm.Free()


def _service(comm: MPI.Comm) -> _Service:
    """``comm``'s service, started on first use (collective)."""
    cache = context(comm).cache
    service = cache.get(_SERVICE)
    if service is None:
        service = cache[_SERVICE] = _Service(comm)
    return service
