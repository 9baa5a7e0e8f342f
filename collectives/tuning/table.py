"""What ``auto`` decides from: measured times per grid size and per size band (pure).

A :class:`Table` holds, for one communicator shape and one kind of memory:

* ``points``: at each size of :data:`GRID` measured so far (4 KiB, 8 KiB, ...,
  powers of two from 256 B to 64 MiB), every candidate's time, the slowest
  rank's, median of interleaved repetitions (:mod:`collectives.tuning.sweep`);
* ``tuned``: per size band (:func:`band`) and candidate set, the times online
  tuning measured on real calls (:mod:`collectives.tuning.online`);
* ``check``: the time of one cross-rank argument check where it does not ride
  along with the data;
* ``excluded``: candidates left out, with the reason (the MPI library's result
  differed between ranks).

:func:`Table.decide` picks, for a size, the candidate with the least
estimated time: the online-tuned times of its band if it has them, else the
grid's: a grid size's own measurements, between two grid sizes the straight
line between the two measurements (all-reduce times are close to linear in
the size over a factor of two), below the grid the smallest grid size's
(latency-bound), above it the line through the two largest. The argument
check is added where it does not ride along (``check_rides``). Nothing here
communicates: every rank holds the same table, so every rank decides alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .costmodel import Choice

#: Grid sizes (bytes) at which the candidates are measured: 256 B to 64 MiB, factor 2.
GRID = tuple(1 << k for k in range(8, 27))

#: Bands per factor of two (:func:`band`).
BANDS_PER_OCTAVE = 4


def band(nbytes: int) -> int:
    """The size band of ``nbytes``: bands are a quarter of a factor of two wide,
    centred on the powers of two and on 2^(k/4)."""
    return round(BANDS_PER_OCTAVE * math.log2(max(nbytes, 1)))


def band_key(nbytes: int, candidates: Iterable[str]) -> str:
    """The key under which online tuning's times for ``nbytes`` among ``candidates``
    are kept: the band and, since the candidates depend on the dtype, the set."""
    return f"{band(nbytes)}:{','.join(sorted(candidates))}"


def needed(nbytes: int) -> tuple[int, ...]:
    """The grid sizes whose measurements estimate ``nbytes`` (see :meth:`Table.estimate`)."""
    if nbytes <= GRID[0]:
        return (GRID[0],)
    if nbytes >= GRID[-1]:
        return GRID[-2:]
    hi = next(s for s in GRID if s >= nbytes)
    return (hi,) if hi == nbytes else (hi // 2, hi)


@dataclass
class Table:
    """Measured times of the candidates (module docstring); seconds."""

    points: dict[int, dict[str, float]] = field(default_factory=dict)
    tuned: dict[str, dict[str, float]] = field(default_factory=dict)
    check: float | None = None
    excluded: dict[str, str] = field(default_factory=dict)
    #: What came from the persisted cache (not saved: the source of a decision).
    loaded: set[Any] = field(default_factory=set)
    #: What this process dropped as stale (:meth:`drop`; not saved): a merge with the
    #: persisted file does not bring it back.
    dropped: set[Any] = field(default_factory=set)

    def estimate(self, name: str, nbytes: int) -> float | None:
        """``name``'s estimated time for ``nbytes`` from the grid (module docstring); None
        if a grid size it needs has no time for it."""
        sizes = needed(nbytes)
        times = [t for s in sizes if (t := self.points.get(s, {}).get(name)) is not None]
        if len(times) < len(sizes):
            return None
        if len(sizes) == 1:
            return times[0]
        (s0, s1), (t0, t1) = sizes, times
        return max(t0 + (nbytes - s0) * (t1 - t0) / (s1 - s0), 0.0)

    def band(self, nbytes: int, candidates: Iterable[str]) -> str:
        """The key of online tuning's times for ``nbytes`` among ``candidates`` (those
        not excluded; :func:`band_key`)."""
        return band_key(nbytes, [c for c in candidates if c not in self.excluded])

    def estimates(
        self, nbytes: int, candidates: Iterable[str], validate: bool, check_rides: Callable[[str], bool]
    ) -> dict[str, float]:
        """Every candidate's (not excluded) estimated time for ``nbytes`` from the grid,
        with the argument check where it does not ride along; those whose grid sizes
        are not measured are left out."""
        times = {c: t for c in candidates if c not in self.excluded and (t := self.estimate(c, nbytes)) is not None}
        return self._checked(times, validate, check_rides)

    def _checked(self, times: dict[str, float], validate: bool, check_rides: Callable[[str], bool]) -> dict[str, float]:
        check = (self.check or 0.0) if validate else 0.0
        return {c: t + (0.0 if check_rides(c) else check) for c, t in times.items()}

    def decide(
        self,
        nbytes: int,
        candidates: Iterable[str],
        validate: bool,
        check_rides: Callable[[str], bool],
        where: str = "",
    ) -> Choice:
        """The candidate with the least estimated time for ``nbytes`` (with the argument
        check if ``validate``), every candidate's estimate and the reason (``where``:
        the communicator, for it); the grid sizes :func:`needed` names must be measured."""
        candidates = list(candidates)
        key = self.band(nbytes, candidates)
        tuned = self.tuned.get(key)
        if tuned:
            preds, source = self._checked(tuned, validate, check_rides), "online tuning"
            origin: Any = key
        else:
            preds = self.estimates(nbytes, candidates, validate, check_rides)
            source, origin = "calibration", needed(nbytes)[-1]
        ranked = sorted(preds, key=lambda c: (preds[c], c))
        best = ranked[0]
        if origin in self.loaded:
            source = f"cached {source}"
        runner = f", next {ranked[1]} {preds[ranked[1]] * 1e6:.1f} us" if len(ranked) > 1 else ""
        left_out = "".join(f"; {c} left out: {why}" for c, why in self.excluded.items() if c in candidates)
        reason = (
            f"auto: {best} for {nbytes} B {where}, {'checked' if validate else 'unchecked'}: {source}, "
            f"{preds[best] * 1e6:.1f} us, the least of {len(preds)}{runner}{left_out}"
        )
        return Choice(best, nbytes, {c: preds[c] for c in ranked}, reason, source)

    def to_json(self) -> dict[str, Any]:
        """The measurements as a JSON object (what :meth:`from_json` reads)."""
        return {
            "points": {str(s): t for s, t in sorted(self.points.items())},
            "tuned": self.tuned,
            "check": self.check,
            "excluded": self.excluded,
        }

    @classmethod
    def from_json(cls, raw: Any) -> Table:
        """A table from :meth:`to_json`'s object, everything in it marked as loaded.

        Raises:
            ValueError: not such an object (a damaged or foreign file).
        """
        try:
            points = {int(s): _times(t) for s, t in raw["points"].items()}
            tuned = {str(k): _times(t) for k, t in raw["tuned"].items()}
            check = raw["check"]
            excluded = {str(k): str(v) for k, v in raw["excluded"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a table of measurements: {exc!r}") from None
        if check is not None and not _seconds(check):
            raise ValueError(f"check time {check!r} is not a number of seconds")
        return cls(points, tuned, check, excluded, {*points, *tuned})

    def drop(self, nbytes: int) -> None:
        """Forget the grid sizes ``nbytes`` needs and the online tunings of its band, here
        and in the persisted file when this table is saved over it (:meth:`merge`), so
        that the next choice of the size measures anew."""
        sizes = needed(nbytes)
        tunings = [key for key in self.tuned if key.startswith(f"{band(nbytes)}:")]
        for size in sizes:
            self.points.pop(size, None)
        for key in tunings:
            del self.tuned[key]
        self.loaded.difference_update(sizes, tunings)
        self.dropped.update(sizes, tunings)

    def merge(self, other: Table) -> None:
        """Add what ``other`` has and this table lacks and has not dropped (this table's
        entries win)."""
        for s, times in other.points.items():
            if s not in self.dropped:
                self.points.setdefault(s, times)
        for k, times in other.tuned.items():
            if k not in self.dropped:
                self.tuned.setdefault(k, times)
        if self.check is None:
            self.check = other.check
        for c, why in other.excluded.items():
            self.excluded.setdefault(c, why)


def _seconds(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _times(raw: Any) -> dict[str, float]:
    if not isinstance(raw, dict) or not all(isinstance(k, str) and _seconds(v) for k, v in raw.items()):
        raise ValueError(f"{raw!r} is not an object of candidate names and seconds")
    return {k: float(v) for k, v in raw.items()}
