"""The stall inspector's bookkeeping, without a stall: what it reads of a slot that
its thread changes while it reads."""

from __future__ import annotations

import time

from collectives.transport import watchdog


class EndingSlot(watchdog.Slot):
    """A slot whose wait ends right after the inspector first reads its time stamp:
    what the inspector sees when the blocked thread returns from MPI and sets
    ``since = 0.0`` between two of the inspector's reads (the race is timing
    dependent; this makes it happen on every call)."""

    def __init__(self, since: float) -> None:
        super().__init__()
        self.stamps = [since]

    @property  # type: ignore[override]  # a property over Slot's attribute
    def since(self) -> float:
        return self.stamps.pop(0) if self.stamps else 0.0

    @since.setter
    def since(self, value: float) -> None:
        self.stamps = [value]


def test_a_wait_that_ends_while_it_is_read_has_no_absurd_age() -> None:
    slot = EndingSlot(0.0)
    with watchdog._lock:
        watchdog._slots.append(slot)
    try:
        ages = []
        for _ in range(3):
            slot.since = time.perf_counter() - 0.5  # blocked for half a second, and about to return
            ages += [age for key, age, _ in watchdog._stalls() if key[0] == id(slot)]
    finally:
        with watchdog._lock:
            watchdog._slots.remove(slot)
    # Before the fix the age was "now - 0": the seconds since the clock's origin (the
    # machine's uptime), reported as a stall of hundreds of seconds.
    assert all(0.5 <= age < 5 for age in ages), ages
