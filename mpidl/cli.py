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
import importlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from mpi4py import MPI

from . import __version__
from .runtime import init

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


#: The subcommands: name -> (module, one-line help, whether it runs as an MPI job). Each
#: module has ``add_arguments(parser)`` and ``main(args)``; a command line imports only the
#: module it names (every rank of a large job would otherwise import all of them, at a
#: cost in start-up time and in load on a shared file system).
COMMANDS: dict[str, tuple[str, str, bool]] = {
    "info": ("mpidl.info", "report the MPI library, ranks, node layout, torch, CUDA, GPUs", True),
    "bench": ("mpidl.bench", "time the all-reduce algorithms against native MPI_Allreduce", True),
    "step-bench": (
        "mpidl.stepbench",
        "time a training step: local, communication alone, mpidl with and without overlap, DDP",
        True,
    ),
    "train": ("mpidl.train", "train a model with a data-parallel algorithm, metrics per epoch", True),
    "compare": ("mpidl.compare", "compare mpidl train runs (JSON) by their time to a target accuracy", True),
    "simulate": (
        "mpidl.simulate.cli",
        "simulate an algorithm on n workers in virtual time, one process (real gradients, modelled network)",
        False,
    ),
}
#: ``mpidl data``'s subcommands, as :data:`COMMANDS`.
DATA_COMMANDS: dict[str, tuple[str, str, bool]] = {
    "fetch": ("mpidl.fetch", "download an IDX dataset's files and check their SHA-256", False),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``mpidl`` command and its subcommands: every subcommand's
    options, or with ``command`` (a name of :data:`COMMANDS` or ``data``) only its own (the
    others listed, their modules not imported)."""
    parser = _Parser(prog="mpidl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"mpidl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_commands(sub, COMMANDS, command)
    p = sub.add_parser("data", help="get the datasets mpidl train reads (fetch)")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="DATA_COMMAND")
    _add_commands(data_sub, DATA_COMMANDS, None if command in (None, "data") else "")
    return parser


def _add_commands(sub: Any, commands: dict[str, tuple[str, str, bool]], only: str | None) -> None:
    """A subparser for each of ``commands``, with its module's options where ``only`` is None
    or names it."""
    for name, (module_name, help_text, mpi) in commands.items():
        p = sub.add_parser(name, help=help_text)
        if only is None or only == name:
            module = importlib.import_module(module_name)
            p.description = (module.__doc__ or "").split("\n\n")[0]
            module.add_arguments(p)
            p.set_defaults(run=module.main, mpi=mpi)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpidl`` console script; returns the exit status."""
    words = sys.argv[1:] if argv is None else list(argv)
    command = words[0] if words and (words[0] in COMMANDS or words[0] == "data") else None
    args = build_parser(command).parse_args(words)
    if args.mpi:
        init(stall_warn=STALL_WARN, stall_abort=STALL_ABORT)
    return int(args.run(args) or 0)


__all__ = ["COMMANDS", "DATA_COMMANDS", "STALL_ABORT", "STALL_WARN", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
