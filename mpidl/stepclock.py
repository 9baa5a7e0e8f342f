"""How long a worker's step computes: as measured, stretched by its slowdowns, or paced.

``mpidl train`` computes every step's gradient for real, on the worker's
real batch, and measures the wall time c it took (zeroing the gradients,
forward and backward pass, device work included). Then, before the
algorithm's step (communication and update, never stretched):

* **unpaced** (the default): a step slowed by a factor f > 1
  (:mod:`mpidl.slowdowns`) sleeps (f - 1) c, so that its computation takes
  f c; a step at f = 1 does not wait;
* **paced** (``--step-time C``): every step sleeps max(0, f C - c - u), u
  being what the worker's previous ``step()`` took besides communicating
  (the optimizer's update), so that the worker's own work of a step takes
  f C whatever c and u were, as a step of a large model on a GPU (forward,
  backward and update) takes a set time. The update is counted into the
  next step's pace because it follows the communication inside ``step()``:
  left out, it would add to every step, and where many workers share a
  core their updates, all due at the same moment, take several times their
  own length. A step whose c + u exceeds f C is not paced; it is counted as
  an *overrun* (``mpidl train`` reports them: pacing then no longer holds,
  choose a larger C or fewer workers per core).

Paced, a worker's core idles most of each step, so many workers share few
cores and each still computes its real gradient: 16 to 32 workers of a
small model on a 2-core machine behave like a cluster of GPU workers whose
steps take C, and the algorithms train for real. The waits on the
communication path must then leave the cores to the computing ranks: MPICH's
blocking waits busy-poll, and a rank waiting for a slow peer would spin for
the whole of the peer's step. So paced workers make their main thread's
waits poll with back-off sleeps (:func:`collectives.transport.p2p.poll_waits`:
the point-to-point waits, the shared-memory barrier, the argument check, the
step budget), as the service threads always do; ``--polled-waits`` and
``--no-polled-waits`` choose either way in either mode. MPI's own collectives
(the evaluation between epochs, the set-up) still block.

Faithfulness: AllReduce-SGD's paced step (no overlap) should take C + T,
T the all-reduce alone of the model's size on the same cluster;
``jobs/emulate/faithful.py`` measures both in one job.
"""

from __future__ import annotations

import argparse
import re
import time

from .slowdowns import Slowdowns

_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|us)\s*")
_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_duration(text: str) -> float:
    """Seconds of a duration with its unit: "150ms", "0.2s", "500us" (``--step-time``)."""
    match = _DURATION.fullmatch(text)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive time with its unit, e.g. 150ms or 0.2s, got {text!r}")
    return float(match.group(1)) * _UNIT[match.group(2)]


class StepClock:
    """Stretches one worker's computation of every step (module docstring).

    Args:
        slowdowns: the worker's slowdown factor per step.
        step_time: the paced computation time C in seconds, or None (unpaced).
    """

    def __init__(self, slowdowns: Slowdowns, step_time: float | None) -> None:
        self.slowdowns, self.step_time = slowdowns, step_time

    @property
    def active(self) -> bool:
        """Whether any step may wait (paced, or some step slowed)."""
        return self.step_time is not None or self.slowdowns.active

    def pause(self, step: int, computed_s: float, updated_s: float = 0.0) -> tuple[float, bool]:
        """Sleep out this worker's ``step``-th step after a computation of ``computed_s``
        seconds (paced: and an update of ``updated_s`` in the previous step); return the
        step's slowdown factor and whether it overran its paced time."""
        factor = self.slowdowns.factor(step)
        paced = self.step_time is not None
        if self.step_time is not None:
            rest = factor * self.step_time - computed_s - updated_s
        else:
            rest = (factor - 1) * computed_s
        if rest > 0:
            time.sleep(rest)
        return factor, paced and rest < 0


__all__ = ["StepClock", "parse_duration"]
