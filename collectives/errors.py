"""Exceptions raised by the collectives, and the warning of a renamed keyword or name."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any


class CollectiveError(RuntimeError):
    """Base class of every error raised by :mod:`collectives`."""


class ArgumentError(CollectiveError, ValueError):
    """A collective was called with invalid or disagreeing arguments.

    With validation on (the default), this is raised on *every* rank of the
    communicator with the same message, before any data moved: the caller's
    buffer is untouched.

    Attributes:
        ranks: the ranks whose arguments were at fault (empty when the fault is
            a disagreement that no single rank owns).
        buffer_untouched: always True; kept as an attribute so that callers who
            catch the error can say so in their own reports.
    """

    buffer_untouched = True

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


def renamed(what: str, old: str, new: str, stacklevel: int = 3) -> None:
    """Warn (``DeprecationWarning``, at the caller's caller) that ``what``'s ``old`` is now ``new``.

    Old names keep working for one release after they are renamed, with this warning.
    """
    warnings.warn(
        f"{what}: {old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_keyword(what: str, old: str, new: str, old_value: Any, new_value: Any, default: Any) -> Any:
    """The value of keyword ``new`` of ``what``, given the deprecated keyword ``old``
    (None where the caller did not pass it; else :func:`renamed` warns).

    Raises:
        TypeError: both were passed (``new_value`` is not ``default``).
    """
    if old_value is None:
        return new_value
    if new_value != default:
        raise TypeError(f"{what} got both {old}= and {new}=; pass {new}= alone")
    renamed(what, f"the keyword {old}=", f"{new}=", stacklevel=4)
    return old_value
