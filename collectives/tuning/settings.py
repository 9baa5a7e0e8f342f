"""The switches of ``auto``'s tuning: online tuning, the watch, determinism, the persisted cache.

Read from the environment when :mod:`collectives` is imported, changed with
:func:`set_tuning`:

==================== ======================== ==========================================
switch               environment (default)    what it does
==================== ======================== ==========================================
``online``           ``MPIDL_ONLINE_TUNING``  time the candidates that the calibration
                     (1)                      finds close on the first calls of a size
                                              band, keep the fastest
                                              (:mod:`collectives.tuning.online`)
``watch``            ``MPIDL_WATCH`` (1)      time the choice's calls, probe its rivals
                                              on them, measure anew where they drift
                                              (:mod:`collectives.tuning.watch`)
``deterministic``    ``MPIDL_DETERMINISTIC``  tune, and watch, on a copy of the first
                     (0)                      call's buffer, so that every real call of a
                                              size runs one algorithm (one summation order)
``cache``            ``MPIDL_TUNING_CACHE``   read and write the measurements under
                     (1)                      ``MPIDL_CACHE_DIR`` (:mod:`collectives.tuning.cache`)
==================== ======================== ==========================================

Ranks follow rank 0: its switches are sent to all when a tuning starts and
when the cache is read, so ranks with different environments still take the
same collective steps.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

_FALSE = {"0", "false", "no", "off"}


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in _FALSE


@dataclass(frozen=True)
class TuningSettings:
    """What ``auto`` may do beyond its calibration (module docstring)."""

    online: bool = True
    deterministic: bool = False
    cache: bool = True
    watch: bool = True


_current = TuningSettings(
    online=_flag("MPIDL_ONLINE_TUNING", True),
    watch=_flag("MPIDL_WATCH", True),
    deterministic=_flag("MPIDL_DETERMINISTIC", False),
    cache=_flag("MPIDL_TUNING_CACHE", True),
)


def current() -> TuningSettings:
    """The switches in force on this rank."""
    return _current


def set_tuning(
    *,
    online: bool | None = None,
    deterministic: bool | None = None,
    cache: bool | None = None,
    watch: bool | None = None,
) -> TuningSettings:
    """Change the given switches (None keeps one) and return the previous settings,
    which ``set_tuning(**dataclasses.asdict(previous))`` puts back. Every rank
    should set the same; rank 0's are the ones used (module docstring)."""
    global _current
    previous = _current
    changes = {"online": online, "deterministic": deterministic, "cache": cache, "watch": watch}
    _current = dataclasses.replace(_current, **{k: bool(v) for k, v in changes.items() if v is not None})
    return previous
