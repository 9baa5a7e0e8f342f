"""The ``mpidl`` command: ``mpidl info | bench | step-bench | train | compare | simulate | data fetch``.

Run it under the MPI launcher, e.g. ``mpiexec -n 2 mpidl info``; rank 0
prints, every rank takes part (``mpidl data fetch`` downloads, once, in one
process; ``mpidl simulate`` simulates all its workers in one). Diagnostics
go to stderr after ``mpidl: rank R:``, at the level ``MPIDL_LOG_LEVEL``
names. Exit status (:mod:`mpidl.runtime`): 2 for a usage
error (on every rank alike), 4 when an uncaught exception on some rank
aborted the whole job, 3 when a transfer blocked for 10 minutes did
(:mod:`collectives.transport.watchdog`); ``mpidl data fetch`` 1 when a file
could not be fetched.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from mpi4py import MPI

from . import __version__, bench, compare, fetch, info, stepbench, train
from .runtime import init
from .simulate import cli as simulate

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

#: Stall limits of the commands, in seconds (MPIDL_STALL_WARN / MPIDL_STALL_ABORT override).
STALL_WARN, STALL_ABORT = 60.0, 600.0


#: The values of mpidl 0.1's ``--flag on|off`` options, now ``--flag``/``--no-flag``.
_OLD_SWITCH_VALUES = ("on", "off")


class _Parser(argparse.ArgumentParser):
    """An argument parser that prints help, usage, the version and errors on rank 0 only:
    every rank parses the same command line, and one copy of a message is enough.

    A ``--flag``/``--no-flag`` option (``argparse.BooleanOptionalAction``) also takes
    mpidl 0.1's spelling, ``--flag on|off`` or ``--flag=on|off``, for one more release,
    with a deprecation message.
    """

    def parse_known_args(  # type: ignore[override]  # one signature for typeshed's overloads
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        return super().parse_known_args(self._new_switches(sys.argv[1:] if args is None else args), namespace)

    def _new_switches(self, args: Sequence[str]) -> list[str]:
        """``args`` with each old ``--flag on|off`` of this parser's switches as ``--flag`` or ``--no-flag``."""
        switches = {
            flag
            for action in self._actions
            if isinstance(action, argparse.BooleanOptionalAction)
            for flag in action.option_strings
            if not flag.startswith("--no-")
        }
        out: list[str] = []
        words = list(args)
        while words:
            word = words.pop(0)
            flag, equals, value = word.partition("=")
            if flag not in switches or (equals and value not in _OLD_SWITCH_VALUES):
                out.append(word)
                continue
            if not equals:
                if not words or words[0] not in _OLD_SWITCH_VALUES:  # the new spelling
                    out.append(word)
                    continue
                value = words.pop(0)
            new = flag if value == "on" else "--no-" + flag[2:]
            self._print_message(
                f"{self.prog}: warning: '{flag} {value}' is deprecated and goes in the next release; use {new}\n",
                sys.stderr,
            )
            out.append(new)
        return out

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        super().exit(status, message if MPI.COMM_WORLD.Get_rank() == 0 else None)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mpidl`` command and its subcommands."""
    parser = _Parser(prog="mpidl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mpidl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="report the MPI library, ranks, node layout, torch, CUDA, GPUs")
    info.add_arguments(p)
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
    p = sub.add_parser(
        "simulate",
        help="simulate an algorithm on n workers in virtual time, one process (real gradients, modelled network)",
        description=simulate.__doc__.split("\n\n")[0],
    )
    simulate.add_arguments(p)
    p.set_defaults(run=simulate.main, mpi=False)
    p = sub.add_parser("data", help="get the datasets mpidl train reads (fetch)")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    p = data_sub.add_parser(
        "fetch",
        help="download an IDX dataset's files and check their SHA-256",
        description=fetch.__doc__.split("\n\n")[0],
    )
    fetch.add_arguments(p)
    p.set_defaults(run=fetch.main, mpi=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpidl`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if getattr(args, "mpi", True):
        init(stall_warn=STALL_WARN, stall_abort=STALL_ABORT)
    return int(args.run(args) or 0)


__all__ = ["STALL_ABORT", "STALL_WARN", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
