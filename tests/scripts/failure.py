"""Failure injection for tests/test_failures.py: ``python failure.py MODE`` under mpiexec.

Modes:
  stall    rank 1 stops calling collectives (sleeps); the others block in an all-reduce.
  preduce  rank 2 stops calling PReduce.average(); groups that draft it block.
  raise    rank 1 raises in the middle of the run.
  kill     rank 1 is killed (SIGKILL) in the middle of the run.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import collectives
import mpidl

comm = mpidl.init()
rank = comm.Get_rank()
mode = sys.argv[1]
x = np.ones(1000, np.float32)

if mode == "preduce":
    with collectives.PReduce(x, comm, group_size=2, policy="random", seed=1) as pr:
        for step in range(1000):
            if rank == 2 and step == 1:
                time.sleep(600)
            pr.average()
    sys.exit(0)

for step in range(100000):
    if step == 5 and rank == 1:
        if mode == "stall":
            time.sleep(600)
        elif mode == "raise":
            raise RuntimeError("injected failure on rank 1")
        elif mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    collectives.allreduce(x, comm, algorithm="ring")
    x[:] = 1.0
