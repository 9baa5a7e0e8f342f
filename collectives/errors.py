"""Exceptions raised by the collectives."""

from __future__ import annotations

from collections.abc import Sequence


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
