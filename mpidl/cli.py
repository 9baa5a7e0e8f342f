"""The ``mpidl`` command: ``mpidl info | bench | step-bench | train | compare``.

Run it under the MPI launcher, e.g. ``mpiexec -n 2 mpidl info``; rank 0
prints, every rank takes part. An uncaught exception on any rank aborts the
whole job (exit code 2), and a transfer blocked for 10 minutes aborts it too
(exit code 3; see :mod:`collectives.transport.watchdog`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from mpi4py import MPI

from . import bench, compare, info, stepbench, train
from .runtime import init

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

#: Stall limits of the commands, in seconds (MPIDL_STALL_WARN / MPIDL_STALL_ABORT override).
STALL_WARN, STALL_ABORT = 60.0, 600.0


class _Parser(argparse.ArgumentParser):
    """An argument parser that prints help, usage and errors on rank 0 only: every
    rank parses the same command line, and one copy of a message is enough."""

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super().print_help(file)

    def print_usage(self, file: SupportsWrite[str] | None = None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super().print_usage(file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        super().exit(status, message if MPI.COMM_WORLD.Get_rank() == 0 else None)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpidl`` command and its subcommands."""
    parser = _Parser(prog="mpidl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="report the MPI library, thread level, ranks and node layout")
    p.set_defaults(run=info.main)
    p = sub.add_parser(
        "bench",
        help="time the all-reduce algorithms against native MPI_Allreduce",
        description=bench.__doc__.split("\n\n")[0],
    )
    bench.add_arguments(p)
    p.set_defaults(run=bench.main)
    p = sub.add_parser(
        "step-bench",
        help="time a training step: local, communication alone, mpidl with and without overlap, DDP",
        description=stepbench.__doc__.split("\n\n")[0],
    )
    stepbench.add_arguments(p)
    p.set_defaults(run=stepbench.main)
    p = sub.add_parser(
        "train",
        help="train a model with a data-parallel algorithm, metrics per epoch",
        description=train.__doc__.split("\n\n")[0],
    )
    train.add_arguments(p)
    p.set_defaults(run=train.main)
    p = sub.add_parser(
        "compare",
        help="compare mpidl train runs (JSON) by their time to a target accuracy",
        description=compare.__doc__.split("\n\n")[0],
    )
    compare.add_arguments(p)
    p.set_defaults(run=compare.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpidl`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    init(stall_warn=STALL_WARN, stall_abort=STALL_ABORT)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
