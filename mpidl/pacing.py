"""Epochs of asynchronous training: a step budget shared by all workers.

With AD-PSGD or Prague (random or smart groups) the workers step at their own
speeds (``Algorithm.uneven_steps``), so an epoch cannot be "every worker
takes S steps": the slowest worker would set the pace, which is what
asynchrony is for avoiding. An epoch is instead
n x S steps taken by all workers together — as many batches as a synchronous
epoch — and a fast worker takes more of them than a slow one.

:class:`StepBudget` keeps that count. Every worker reports each step to a
counting thread on rank 0 (a 16-byte message, not waited for); when the total
reaches the end of the epoch, the thread tells every worker, and each worker
looks for that word before its next step (the test of a receive posted in
advance). The epoch ends on every worker at its next step boundary after the
word arrived, so all workers together overshoot the budget by the steps
they began while the count and the word were on their way (a step or so
each; more where rank 0's thread waits for a core: 13 steps of 4 workers
together were seen with 4 ranks on 2 cores); the overshoot counts towards
the next epoch (epoch e ends when the
total reaches e x n x S). The thread polls for
messages with short sleeps (:class:`collectives.transport.p2p.Backoff`), leaving the
cores to the workers. It needs ``MPI_THREAD_MULTIPLE`` (refused below it), and an
exception in it ends the job (:mod:`collectives.transport.threads`).
"""

from __future__ import annotations

import threading

import numpy as np
from mpi4py import MPI

from collectives.transport import p2p, threads

_STEP, _CLOSE = 1, 2
_TO_COUNTER, _EPOCH_OVER = 0x7301, 0x7302


class StepBudget:
    """Counts the steps of all workers of ``comm`` against epochs of ``per_epoch`` steps.

    Construction and :meth:`close` are collective. Each worker calls
    :meth:`begin_epoch`, then :meth:`step` after each of its steps until
    :meth:`over` says the epoch's budget is spent.

    Raises:
        collectives.ArgumentError: MPI does not provide ``MPI_THREAD_MULTIPLE``.
    """

    def __init__(self, comm: MPI.Comm, per_epoch: int) -> None:
        if per_epoch < 1:
            raise ValueError(f"an epoch needs at least one step, got {per_epoch}")
        threads.require_multiple("the step budget counts the workers' steps on a service thread")
        self.per_epoch = per_epoch
        self._comm = comm.Dup()
        self._msg = np.array([_STEP, 0], np.int64)
        self._word = np.zeros(1, np.int64)
        self._over: MPI.Request | None = None
        self._thread: threading.Thread | None = None
        if self._comm.Get_rank() == 0:
            self._thread = threads.start(self._count, "mpidl-step-budget")

    def begin_epoch(self) -> None:
        """Start listening for the end of the next epoch."""
        self._over = self._comm.Irecv(self._word, 0, _EPOCH_OVER)

    def step(self) -> None:
        """Report one step of this worker (polled where this thread's waits poll:
        :func:`collectives.transport.p2p.poll_waits`)."""
        self._msg[0] = _STEP
        p2p.complete(self._comm.Isend(self._msg, 0, _TO_COUNTER))

    def over(self) -> bool:
        """Whether the current epoch's budget is spent (its end was announced)."""
        assert self._over is not None, "over() before begin_epoch()"
        return bool(self._over.Test())

    def close(self) -> None:
        """Stop counting (collective; after the last epoch is over on every worker)."""
        self._msg[0] = _CLOSE
        p2p.complete(self._comm.Isend(self._msg, 0, _TO_COUNTER))
        if self._thread is not None:  # it ends once every worker has closed
            p2p.operation("StepBudget.close() (waiting for every worker's close())")
            with p2p.waiting(self._comm):
                self._thread.join()
        self._comm.Free()

    def _count(self) -> None:
        """Rank 0's thread: add up the steps, announce each epoch's end, stop when all closed."""
        comm, n = self._comm, self._comm.Get_size()
        msg, status, backoff = np.zeros(2, np.int64), MPI.Status(), p2p.Backoff()
        total, epoch, closed = 0, 1, 0
        sends: list[tuple[MPI.Request, np.ndarray]] = []
        while closed < n:
            if not comm.Iprobe(MPI.ANY_SOURCE, _TO_COUNTER, status):
                backoff.sleep()
                continue
            backoff.reset()
            comm.Recv(msg, status.Get_source(), _TO_COUNTER)
            if msg[0] == _CLOSE:
                closed += 1
                continue
            total += 1
            if total >= epoch * self.per_epoch:
                word = np.array([epoch], np.int64)
                sends += [(comm.Isend(word, w, _EPOCH_OVER), word) for w in range(n)]
                epoch += 1
            sends = [s for s in sends if not s[0].Test()]
        MPI.Request.Waitall([r for r, _ in sends])
