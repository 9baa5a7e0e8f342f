"""MPI start-up for mpidl programs."""

from __future__ import annotations

import sys

from mpi4py import MPI


def init() -> MPI.Intracomm:
    """Initialise MPI for mpidl (idempotent) and return ``MPI.COMM_WORLD``.

    mpidl needs ``MPI_THREAD_MULTIPLE`` (asynchronous algorithms communicate
    from a service thread), which is mpi4py's default. If the program
    initialised MPI itself with a lower level, this raises instead of
    failing later in a thread.
    """
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                 MPI.THREAD_SERIALIZED: "serialized"}
        print(f"mpidl: MPI provides thread level {names.get(provided, provided)}; "
              "asynchronous algorithms need 'multiple' (set mpi4py.rc.thread_level = 'multiple' "
              "before importing mpi4py.MPI)", file=sys.stderr)
    return MPI.COMM_WORLD
