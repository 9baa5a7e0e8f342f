"""Helpers for MPI tests: communicators of a given size, collective asserts,
and launching a script under a separate ``mpiexec`` for 5..8 ranks."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np
import pytest
from mpi4py import MPI
from shm_segments import remove_orphaned_segments, segments

_SPLITS: dict[int, MPI.Intracomm] = {}

#: Environment variables of the launcher that must not leak into a nested mpiexec.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCAL", "MPIR_CVAR_CH4_", "OMPI_", "SLURM_")

#: Marks a test, or one parameter of a test, that needs torch (an optional dependency):
#: skipped where torch is not installed.
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")


def comm_of_size(k: int) -> MPI.Intracomm:
    """A communicator of min(k, world size) ranks containing this rank.

    COMM_WORLD is split into consecutive blocks of k ranks (the last block may
    be smaller), so every rank is busy in every test. Collective over
    COMM_WORLD on first use of each k; cached afterwards.
    """
    world = MPI.COMM_WORLD
    if k not in _SPLITS:
        _SPLITS[k] = world.Split(world.rank // k, world.rank)
    return _SPLITS[k]


def all_ok(comm: MPI.Comm, ok: bool) -> bool:
    """True on every rank iff ``ok`` holds on every rank of ``comm``."""
    return bool(comm.allreduce(bool(ok), op=MPI.LAND))


def random_start(comm: MPI.Comm, seed: int, length: int) -> tuple[np.random.Generator, float, np.ndarray]:
    """This rank's generator (seeded by seed and rank), a speed factor in [0.2, 3) to scale
    its random delays by, and random float64 parameters of ``length``."""
    rng = np.random.default_rng([seed, comm.Get_rank()])
    return rng, rng.uniform(0.2, 3.0), rng.standard_normal(length)


def spread(comm: MPI.Comm, x: np.ndarray) -> float:
    """Largest difference between two ranks' copies of one element of ``x``."""
    hi, lo = np.empty_like(x), np.empty_like(x)
    comm.Allreduce(x, hi, op=MPI.MAX)
    comm.Allreduce(x, lo, op=MPI.MIN)
    return float((hi - lo).max())


def gather_failures(comm: MPI.Comm, failures: Sequence[str]) -> list[str]:
    """Every rank's failure messages, prefixed with the rank, on every rank."""
    return [f"rank {r}: {f}" for r, fs in enumerate(comm.allgather(list(failures))) for f in fs]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ without the running launcher's variables, for a nested mpiexec."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(extra or {})
    return env


def mpiexec(
    n: int,
    args: Sequence[str],
    timeout: float = 300,
    hosts: str | None = None,
    env: dict[str, str] | None = None,
    options: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Run ``python args...`` on ``n`` ranks under a fresh mpiexec and return the result.

    ``hosts`` (e.g. "a:2,b:2") makes MPICH's launcher emulate several nodes on
    this machine; ``options`` go to mpiexec (e.g. ``-disable-auto-cleanup``: a
    rank that ends does not end the others). Output is captured; the run is
    killed after ``timeout`` s.
    """
    launcher = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    cmd = [launcher, *options, "-n", str(n)]
    if hosts:
        cmd += ["-launcher", "fork", "-hosts", hosts]
    cmd += [sys.executable, *args]
    before = segments()
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env(env))
    finally:
        remove_orphaned_segments(before)


def on_rank0_quietly(fn, *args, **kwargs):
    """Run ``fn`` on COMM_WORLD rank 0 while the other ranks wait without spinning.

    The result (or exception) is broadcast, so every rank returns it or raises.
    Waiting ranks poll a non-blocking barrier with sleeps, leaving the cores to
    whatever rank 0 started (e.g. a nested mpiexec).
    """
    world = MPI.COMM_WORLD
    result, error = None, None
    if world.rank == 0:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised on every rank below
            error = exc
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.02)
    result, error = world.bcast((result, error), root=0)
    if error is not None:
        raise error
    return result
