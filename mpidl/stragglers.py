"""Which worker is slow: each worker's step, computation and waiting, and the CPU they used.

``mpidl train`` times every step of every worker (:class:`StepTimes`):

* ``step``: from the start of the gradient's computation to the end of the
  algorithm's ``step()``;
* ``gradient``: the computation alone (zeroing, forward, backward, device work);
* ``compute``: the gradient plus the wait of a paced or slowed step
  (:mod:`mpidl.stepclock`): the time the worker spent being a worker of its speed;
* ``comm_wait``: the time its steps spent communicating or waiting for
  communication (:attr:`algorithms.Algorithm.comm_wait_s`; 0 for the peers DDP
  and Horovod, whose communication hides in the backward pass).

A worker's *own time* per step is its step less its communication and
waiting: computing, pacing, updating. In a synchronous algorithm every worker's
step takes as long as the slowest one's (they wait for it), so the step time
cannot tell which worker is slow; the own time can: the slow worker waits
least. :func:`report` names the worker with the longest own time when it is
more than :data:`SLOW` times the median worker's.

CPU: every worker's process CPU time (:func:`time.process_time`, all its
threads) over the training, evaluations included, and the share of the
machine's cores that were busy meanwhile as rank 0's ``/proc/stat`` counts
them (Linux; all processes, the kernel's network work included, so on a
shared machine other jobs too; on the emulated cluster, whose nodes share one
kernel, the whole machine).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from mpi4py import MPI

#: A worker whose own time per step exceeds the median worker's this many times is named.
SLOW = 1.5

_PROC_STAT = "/proc/stat"


@dataclass
class StepTimes:
    """One worker's steps: how many, and the seconds of each phase summed over them
    (module docstring); ``slowed``: steps with a slowdown factor above 1;
    ``overruns``: paced steps whose gradient alone outlasted the paced time."""

    steps: int = 0
    step_s: float = 0.0
    gradient_s: float = 0.0
    compute_s: float = 0.0
    comm_wait_s: float = 0.0
    slowed: int = 0
    overruns: int = 0

    def add(
        self, gradient_s: float, compute_s: float, step_s: float, comm_wait_s: float, factor: float, overrun: bool
    ) -> None:
        """Count one step."""
        self.steps += 1
        self.gradient_s += gradient_s
        self.compute_s += compute_s
        self.step_s += step_s
        self.comm_wait_s += comm_wait_s
        self.slowed += factor > 1
        self.overruns += overrun

    def state(self) -> dict[str, Any]:
        """JSON-able, for a checkpoint."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StepTimes:
        return cls(**{f.name: state[f.name] for f in fields(cls)})


def machine_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all the machine's cores so far (``/proc/stat``), or
    None where there is none."""
    try:
        with open(_PROC_STAT) as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle, iowait
    total = sum(values[:8])  # guest time is counted in user already
    return total - idle, total


class CpuMeter:
    """This process's CPU time and the machine's busy ticks between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self.cpu_s = self.wall_s = 0.0
        self.machine: tuple[int, int] | None = None

    def start(self) -> None:
        self._cpu0, self._wall0, self._ticks0 = time.process_time(), time.perf_counter(), machine_ticks()

    def stop(self) -> None:
        self.cpu_s += time.process_time() - self._cpu0
        self.wall_s += time.perf_counter() - self._wall0
        ticks = machine_ticks()
        if ticks is not None and self._ticks0 is not None:
            busy, total = self.machine or (0, 0)
            self.machine = (busy + ticks[0] - self._ticks0[0], total + ticks[1] - self._ticks0[1])


def report(times: StepTimes, cpu: CpuMeter, comm: MPI.Comm) -> dict[str, Any]:
    """Every worker's times and the CPU use (collective); the JSON ``workers`` section
    of ``mpidl train`` on every rank:

    ``steps``, ``slowed_steps``, ``overruns``: per rank; ``mean_s``: per phase
    (``step``, ``gradient``, ``compute``, ``comm_wait``, ``own``), each rank's mean
    seconds per step; ``slowest``: ``{"rank", "own_s", "median_own_s", "ratio"}``
    of the worker whose own time per step is more than :data:`SLOW` times the
    median, else None; ``cpu``: ``cpu_s`` per rank, ``wall_s`` (the longest
    worker's), ``workers_cores`` (all workers' CPU seconds / ``wall_s``: cores busy
    on average), and rank 0's machine: ``machine_cores``, ``machine_busy`` (the
    share of its cores busy, None without ``/proc/stat``).
    """
    rows = comm.allgather((asdict(times), cpu.cpu_s, cpu.wall_s))
    per = [r[0] for r in rows]
    steps = [p["steps"] for p in per]

    def mean(key: str) -> list[float]:
        return [p[key] / max(p["steps"], 1) for p in per]

    means = {name: mean(f"{name}_s") for name in ("step", "gradient", "compute", "comm_wait")}
    means["own"] = [s - w for s, w in zip(means["step"], means["comm_wait"])]
    wall = max(r[2] for r in rows)
    cpu_s = [r[1] for r in rows]
    cores, machine = comm.bcast((os.cpu_count(), cpu.machine), root=0)  # rank 0's machine
    return {
        "steps": steps,
        "slowed_steps": [p["slowed"] for p in per],
        "overruns": [p["overruns"] for p in per],
        "mean_s": means,
        "slowest": slowest(means["own"]),
        "cpu": {
            "cpu_s": cpu_s,
            "wall_s": wall,
            "workers_cores": sum(cpu_s) / wall if wall else 0.0,
            "machine_cores": cores,
            "machine_busy": machine[0] / machine[1] if machine and machine[1] else None,
        },
    }


def slowest(own: list[float]) -> dict[str, Any] | None:
    """The worker of the longest ``own`` time when it exceeds :data:`SLOW` x the median, else None."""
    if not own:
        return None
    median = statistics.median(own)
    rank = max(range(len(own)), key=own.__getitem__)
    if median <= 0 or own[rank] <= SLOW * median:
        return None
    return {"rank": rank, "own_s": own[rank], "median_own_s": median, "ratio": own[rank] / median}


def table(workers: dict[str, Any]) -> str:
    """The lines rank 0 prints at the end: a row per worker (milliseconds per step),
    the slowest worker if one is named, the CPU use."""
    m = workers["mean_s"]
    lines = ["# per worker, mean ms per step: step = compute + comm/wait + update; own = step - comm/wait"]
    lines.append(f"{'rank':>4} {'steps':>6} {'step':>8} {'gradient':>9} {'compute':>8} {'comm/wait':>9} {'own':>8}")
    for r, steps in enumerate(workers["steps"]):
        lines.append(
            f"{r:>4} {steps:>6} {1e3 * m['step'][r]:>8.1f} {1e3 * m['gradient'][r]:>9.1f} "
            f"{1e3 * m['compute'][r]:>8.1f} {1e3 * m['comm_wait'][r]:>9.1f} {1e3 * m['own'][r]:>8.1f}"
        )
    slow = workers["slowest"]
    if slow is not None:
        lines.append(
            f"slowest worker: rank {slow['rank']}, its own time per step {slow['ratio']:.2f} x the median "
            f"worker's ({1e3 * slow['own_s']:.1f} ms against {1e3 * slow['median_own_s']:.1f} ms)"
        )
    overruns = sum(workers["overruns"])
    if overruns:
        lines.append(
            f"paced steps overrun: {overruns} steps computed longer than their paced time "
            f"(ranks {[r for r, k in enumerate(workers['overruns']) if k]}); pacing did not hold for them"
        )
    cpu = workers["cpu"]
    busy = "" if cpu["machine_busy"] is None else f", {100 * cpu['machine_busy']:.0f} % of them busy"
    lines.append(
        f"cpu: the workers used {cpu['workers_cores']:.2f} cores on average over {cpu['wall_s']:.2f} s "
        f"(rank 0's machine: {cpu['machine_cores']} cores{busy})"
    )
    return "\n".join(lines)


__all__ = ["SLOW", "CpuMeter", "StepTimes", "machine_ticks", "report", "slowest", "table"]
