"""The event engine: a virtual clock and the events due at its times.

An event is a callable due at a virtual time; :meth:`Engine.run` pops the
earliest (ties in the order they were scheduled), sets the clock to its time
and calls it, and it may schedule more. Nothing sleeps: a simulated second
costs what its events cost to compute. :meth:`Engine.clock` is the time
source handed to code that reads time (the group generator's ``clock=``).

Cost: O(log e) per event, e the events pending.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable


class Engine:
    """Virtual time and the events pending in it.

    Attributes:
        now: the current virtual time in seconds (0 at the start).
        events: events run so far.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def clock(self) -> float:
        """The current virtual time (a ``time.monotonic`` for the simulated world)."""
        return self.now

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` at virtual time ``when`` (not before now)."""
        if when < self.now:
            raise ValueError(f"an event at {when} s is in the past (now {self.now} s)")
        heapq.heappush(self._heap, (when, next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` ``delay`` seconds from now."""
        self.at(self.now + delay, fn, *args)

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Run events in time order until none is left or ``until()`` holds."""
        heap = self._heap
        while heap and not (until is not None and until()):
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            self.events += 1
            fn(*args)

    def advance(self, delay: float) -> None:
        """Run the events of the next ``delay`` seconds, then set the clock ``delay`` on."""
        end = self.now + delay
        self.run(lambda: self._heap[0][0] > end)
        self.now = end

    @property
    def pending(self) -> int:
        """Events scheduled and not yet run."""
        return len(self._heap)


__all__ = ["Engine"]
