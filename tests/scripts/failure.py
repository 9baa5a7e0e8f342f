"""Failure injection for tests/test_failures.py: ``python failure.py MODE [ARGS]`` under mpiexec.

Modes:
  stall    rank 1 stops calling collectives (sleeps); the others block in an all-reduce.
  preduce  rank 2 stops calling PReduce.average(); groups that draft it block.
  raise    rank 1 raises in the middle of the run.
  raise-with ALGORITHM  rank 1 raises in the middle of a loop inside
           ``with algorithms.create(ALGORITHM, ...) as algo:``.
  kill     rank 1 is killed (SIGKILL) in the middle of the run.
  exit     rank 1 leaves in the middle of the run with os._exit(1) (no MPI_Finalize, no cleanup).
  late OP  rank 1 comes 3 s late into OP, where the others wait for it: ``settle`` or
           ``close`` (P-Reduce), ``neighbor`` (neighbor averaging), ``checkpoint``
           (writing a checkpoint); then the job ends normally.
  thread KIND  a service thread raises: ``budget`` (the step budget's counting thread,
           rank 0), ``group-generator`` (P-Reduce's, rank 0), ``server`` (AD-PSGD's,
           on a passive worker); without that ending the job, it ends normally in 20 s.
  survive ROLE  AD-PSGD with on_failure="continue" on 4 ranks, learning rate 0, random
           float64 models: rank 0 (ROLE ``active``: between two of its averagings) or
           rank 1 (``passive``: holding its model's lock, while requests wait for it)
           kills itself (SIGKILL) in its step 20, having written its model into
           $FAILURE_DIR; the survivors take their 100 steps, close, and print
           ``failure.py: survivors SUM_ERROR LOST SIZE``: the largest difference between
           the survivors' sum and the initial sum less the dead worker's model, the
           world ranks lost, the survivors' communicator size.
  train    ``mpidl train ARGS``, where rank 1 kills itself (SIGKILL) when the checkpoint
           after step $FAILURE_KILL_STEP is due, before writing it; with
           $FAILURE_SAVE_RESTORED=DIR, a resumed run first checkpoints the state it
           restored into DIR (to be compared with the checkpoint it resumed from); with
           $FAILURE_RAISE_STEP=K, rank 0 raises in its training step after K steps.

Just before it fails, the failing rank prints ``failure.py: rank R MODE at T``
(T: time.time()) on stderr, so that a test can measure how long the job took
to end after the failure.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

import collectives
import mpidl

comm = mpidl.init()
rank = comm.Get_rank()
mode = sys.argv[1]


def announce() -> None:
    print(f"failure.py: rank {rank} {mode} at {time.time():.3f}", file=sys.stderr, flush=True)


if mode == "train":
    from mpidl import checkpoint, cli, train

    kill_step = int(os.environ.get("FAILURE_KILL_STEP", -1))
    raise_step = int(os.environ.get("FAILURE_RAISE_STEP", -1))
    save = checkpoint.save
    train_step = train._Run._train_step

    def train_step_or_raise(run: train._Run, batch: object) -> object:
        if run.step == raise_step and rank == 0:
            announce()
            raise RuntimeError("injected failure on rank 0")
        return train_step(run, batch)

    train._Run._train_step = train_step_or_raise

    def save_or_die(directory: str, step: int, *args: object) -> None:
        if step == kill_step and rank == 1:
            announce()
            os.kill(os.getpid(), signal.SIGKILL)
        save(directory, step, *args)

    checkpoint.save = save_or_die
    restored_into = os.environ.get("FAILURE_SAVE_RESTORED")
    if restored_into:
        load = train._Run.load_algorithm_state

        def load_and_save(run: train._Run, state: dict) -> None:
            load(run, state)
            folder, run.config.checkpoint = run.config.checkpoint, restored_into
            run._save()
            run.config.checkpoint = folder

        train._Run.load_algorithm_state = load_and_save
    sys.exit(cli.main(["train", *sys.argv[2:]]))

if mode == "survive":
    import algorithms

    victim = {"active": 0, "passive": 1}[sys.argv[2]]
    faulthandler.dump_traceback_later(40)  # a hang shows where each thread waits
    rng = np.random.default_rng([7, rank])
    x = rng.standard_normal(100)  # 800 bytes: every message is sent eagerly
    total = comm.allreduce(x)
    algo = algorithms.create("adpsgd", x, algorithms.SGD(x, lr=0.0), comm, broadcast_init=False, on_failure="continue")
    for step in range(100):
        if step == 20 and rank == victim:
            if victim == 0 and algo._background is not None and algo._background.pending:
                algo._collect()  # its averaging done on both ends: nothing is in doubt
            else:
                algo._lock.acquire()  # no request is served any more: those in flight are abandoned
            np.save(os.path.join(os.environ["FAILURE_DIR"], "dead.npy"), x)
            announce()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(rng.uniform(0, 2e-3))
        algo.step(np.zeros_like(x))
    algo.close()
    survivors = algo.comm.allreduce(x)
    dead = np.load(os.path.join(os.environ["FAILURE_DIR"], "dead.npy"))
    error = float(np.abs(survivors - (total - dead)).max())
    if algo.comm.Get_rank() == 0:
        print(f"failure.py: survivors {error:.3g} {','.join(map(str, algo.lost))} {algo.comm.Get_size()}", flush=True)
    sys.exit(0)

x = np.ones(1000, np.float32)

if mode == "late":
    op = sys.argv[2]

    def late() -> None:
        if rank == 1:
            announce()
            time.sleep(3)

    if op in ("settle", "close"):
        with collectives.PReduce(x, comm, policy="random") as pr:
            pr.average()
            pr.settle()  # no group left to run: the others wait for rank 1 alone
            late()
            if op == "settle":
                pr.settle()
    elif op == "neighbor":
        size = comm.Get_size()
        row = collectives.NeighborWeights(0.5, {(rank - 1) % size: 0.5}, [(rank + 1) % size])
        collectives.neighbor_allreduce(x, row, comm)
        late()
        collectives.neighbor_allreduce(x, row, comm)
    elif op == "checkpoint":
        from mpidl import checkpoint

        folder = comm.bcast(tempfile.mkdtemp() if rank == 0 else None)
        checkpoint.save(folder, 1, comm, {"x": x}, {})
        late()
        checkpoint.save(folder, 2, comm, {"x": x}, {})
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(folder)
    sys.exit(0)

if mode == "thread":
    kind = sys.argv[2]

    def failing(*args: object) -> None:
        announce()
        raise RuntimeError(f"injected failure in the {kind} thread")

    end = time.time() + 20
    if kind == "budget":
        from mpidl import pacing

        pacing.StepBudget._count = failing
        budget = pacing.StepBudget(comm, 10**9)
        budget.begin_epoch()
        while not budget.over() and time.time() < end:
            budget.step()
            time.sleep(0.01)
    elif kind == "group-generator":
        collectives.GroupGenerator.request = failing
        with collectives.PReduce(x, comm, policy="random") as pr:
            while time.time() < end:
                pr.average()
    elif kind == "server":
        import algorithms
        from algorithms import adpsgd

        adpsgd._Server._serve = failing
        with algorithms.create("adpsgd", x, algorithms.SGD(x, lr=0.0), comm) as algo:
            while time.time() < end:
                algo.step(np.zeros_like(x))
    sys.exit(0)

if mode == "raise-with":
    import algorithms

    with algorithms.create(sys.argv[2], x, algorithms.SGD(x, lr=0.0), comm) as algo:
        for step in range(100000):
            if step == 5 and rank == 1:
                announce()
                raise RuntimeError("injected failure on rank 1")
            algo.step(np.zeros_like(x))

if mode == "preduce":
    with collectives.PReduce(x, comm, group_size=2, policy="random", seed=1) as pr:
        for step in range(1000):
            if rank == 2 and step == 1:
                announce()
                time.sleep(600)
            pr.average()
    sys.exit(0)

for step in range(100000):
    if step == 5 and rank == 1:
        announce()
        if mode == "stall":
            time.sleep(600)
        elif mode == "raise":
            raise RuntimeError("injected failure on rank 1")
        elif mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "exit":
            os._exit(1)
    collectives.allreduce(x, comm, collective="ring")
    x[:] = 1.0
