"""Which worker is slow, and when: fixed and random transient slowdowns, seeded.

A worker's *slowdown factor* in one of its steps multiplies the time that
step's computation takes (:mod:`mpidl.stepclock` applies it). Two kinds
compose by multiplying their factors:

* **fixed** (``--slow RANK:FACTOR``, repeatable): rank RANK is FACTOR times
  as slow in every step, as a worker on an older GPU or a shared node is;
* **random transient** (``--slowdown p=PROB,F=FACTOR,P=STEPS``): each
  worker's own steps are cut into periods of STEPS steps (its steps 0 to
  STEPS - 1, then STEPS to 2 STEPS - 1, ...); in each period the worker is
  FACTOR times as slow with probability PROB, drawn independently for every
  (seed, rank, period). This is the random slowdown with which the Prague
  (Luo et al., ASPLOS 2020) and Hop (Luo et al., ASPLOS 2019) evaluations
  emulate stragglers that come and go (another job on the node, a thermal
  throttle).

The draw depends on the seed, the rank and the period alone, never on time,
on the other workers or on the algorithm, so runs of several algorithms with
the same seed see the same schedule: a worker's k-th step is slowed in all
of them alike (an asynchronous algorithm's worker takes steps of its own
count, and meets the schedule as far as it gets). The seed is the run's
``--seed`` unless the spec names one (``seed=S``). Cost: one generator per
period of a worker, a few microseconds every STEPS steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Mixed into every draw, so the schedule's random numbers are not those of the
#: other generators seeded with the run's seed (the shards, the epochs' order).
_STREAM = 0x51_0D


@dataclass(frozen=True)
class RandomSlowdown:
    """Each period of ``period`` steps of each worker is ``factor`` times as slow with
    probability ``probability``, drawn from (``seed``, rank, period)."""

    probability: float
    factor: float
    period: int
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.probability <= 1:
            raise ValueError(f"the probability p must be in [0, 1], got {self.probability}")
        if not (math.isfinite(self.factor) and self.factor >= 1):
            raise ValueError(f"the factor F must be a number >= 1, got {self.factor}")
        if self.period < 1:
            raise ValueError(f"the period P must be at least one step, got {self.period}")

    def slowed(self, seed: int, rank: int, period: int) -> bool:
        """Whether ``rank`` is slowed in its ``period``-th period (``seed``: the run's,
        unless this slowdown names its own)."""
        own = seed if self.seed is None else self.seed
        return bool(np.random.default_rng([_STREAM, own, rank, period]).random() < self.probability)

    def describe(self) -> dict[str, float | int | None]:
        """The JSON form (``meta["slowdown"]`` of ``mpidl train``)."""
        return {"p": self.probability, "F": self.factor, "P": self.period, "seed": self.seed}


#: The keys of a ``--slowdown`` spec and what they set.
_KEYS = {"p": "probability", "F": "factor", "P": "period", "seed": "seed"}


def parse_random(text: str) -> RandomSlowdown:
    """Parse ``p=PROB,F=FACTOR,P=STEPS[,seed=S]`` (e.g. "p=0.1,F=4,P=10") of ``--slowdown``.

    Raises:
        ValueError: a key missing, unknown or repeated, or a value out of range, saying which.
    """
    values: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in _KEYS:
            raise ValueError(f"bad --slowdown {text!r}: use p=PROB,F=FACTOR,P=STEPS[,seed=S], e.g. p=0.1,F=4,P=10")
        if key in values:
            raise ValueError(f"bad --slowdown {text!r}: {key} given twice")
        values[key] = value
    missing = [k for k in ("p", "F", "P") if k not in values]
    if missing:
        raise ValueError(f"bad --slowdown {text!r}: {', '.join(missing)} missing")
    try:
        return RandomSlowdown(
            float(values["p"]),
            float(values["F"]),
            int(values["P"]),
            int(values["seed"]) if "seed" in values else None,
        )
    except ValueError as exc:
        raise ValueError(f"bad --slowdown {text!r}: {exc}") from None


class Slowdowns:
    """The slowdown factor of every step of one worker: its fixed factor times the
    random one of the step's period.

    Args:
        rank: the worker.
        fixed: fixed factors by rank (``--slow``); ranks not named run at 1.
        random: the random transient slowdown, or None.
        seed: the run's seed (the random slowdown's unless it names its own).
    """

    def __init__(self, rank: int, fixed: dict[int, float], random: RandomSlowdown | None, seed: int) -> None:
        self.rank, self.random, self.seed = rank, random, seed
        self.fixed = fixed.get(rank, 1.0)
        self._period = -1
        self._slowed = False

    @property
    def active(self) -> bool:
        """Whether any step of this worker may be slowed."""
        return self.fixed != 1.0 or (self.random is not None and self.random.probability > 0)

    def factor(self, step: int) -> float:
        """The factor of this worker's ``step``-th step (counted from 0 over the whole run)."""
        if self.random is None:
            return self.fixed
        period = step // self.random.period
        if period != self._period:
            self._period, self._slowed = period, self.random.slowed(self.seed, self.rank, period)
        return self.fixed * self.random.factor if self._slowed else self.fixed


__all__ = ["RandomSlowdown", "Slowdowns", "parse_random"]
