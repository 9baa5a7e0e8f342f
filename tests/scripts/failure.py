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
  survive ROLE [COMPRESSION]  AD-PSGD with on_failure="continue" on 4 ranks, learning
           rate 0, random float64 models (compressed gossip with COMPRESSION): rank 0
           (ROLE ``active``: between two of its averagings) or rank 1 (``passive``:
           holding its model's lock, while requests wait for it)
           kills itself (SIGKILL) in its step 20, having written its model into
           $FAILURE_DIR; the survivors take their 100 steps, close, and print
           ``failure.py: survivors SUM_ERROR LOST SIZE``: the largest difference between
           the survivors' sum and the initial sum less the dead worker's model, the
           world ranks lost, the survivors' communicator size.
  false-alarm NAME  AD-PSGD, Prague (smart pairs) or GR-SGD with on_failure="continue" on
           4 ranks, learning rate 0, random float64 models, a settle every 20 of 60 steps:
           no one dies, but the second agreement that ends a settle answers false on every
           rank; prints ``failure.py: false alarm NAME agreements K same S error E``: S
           whether the algorithm kept the caller's communicator and lost no one, E the
           largest difference of the workers' sum from the initial one.
  trials SEED  AD-PSGD as in ``survive``, 4 ranks: two workers die one after the other,
           at the points of an averaging that SEED gives them in turns (KILL_POINTS:
           an active worker before it sends, during the averaging (both models
           exchanged, its mean not applied) or after it; a passive one before (holding
           its lock) or during (the request received, no reply sent)), each worker
           drawn by SEED on that side and armed after a drawn number of steps; each
           writes into $FAILURE_DIR the model the survivors must count as its own. After
           each recovery the survivors settle and print ``failure.py: trial SEED.K
           SIDE WHEN lost R error E``: E the largest difference of their sum from
           what they held less the dead worker's model.
  prague SEED  Prague (smart pairs) with on_failure="continue" on 4 ranks, learning rate 0,
           random float64 models: three workers die one after the other, each at the
           point of a group's average that PRAGUE_PLANS[SEED] gives it (``before`` it
           sends anything, ``during`` it (its half of the reduce-scatter sent, nothing
           of the all-gather), ``after`` it (its average confirmed by its partner; 0.2 s
           later)), a plain worker or the group generator's host (rank 0 of the
           workers), armed after a number of steps drawn from SEED; each writes into
           $FAILURE_DIR the model the survivors must count as its own (the one it held
           before a failed average). After each recovery the survivors settle and print
           ``failure.py: prague SEED.K WHO WHEN lost R error E``: E the largest
           difference of their sum from what they held less the dead worker's model.
  grsgd SEED  GR-SGD with on_failure="continue" on 4 ranks, learning rate 0, random
           float64 models: three workers die one after the other (rings of 4, 3 and 2
           workers re-linked; the last survivor steps alone), each at the point of an
           exchange with a neighbor that GRSGD_PLANS[SEED] gives it, its other exchanges
           first completed on both ends (0.2 s for the neighbors to apply theirs; where
           they, or the neighbor's half, take over a second, at a later exchange):
           ``before`` it starts the exchange (its neighbor may have started its own
           half), ``during`` it (both snapshots exchanged, its increment not applied) or
           ``after`` it (applied on both ends, 0.2 s later); armed after a number of steps
           drawn from SEED; each writes into $FAILURE_DIR the model the survivors must
           count as its own. After each recovery the survivors settle and print
           ``failure.py: grsgd SEED.K ringN WHEN lost R error E``, N the ring's size
           before the death.
  train    ``mpidl train ARGS``, where rank 1 kills itself (SIGKILL) when the checkpoint
           after step $FAILURE_KILL_STEP is due, before writing it; with
           $FAILURE_SAVE_RESTORED=DIR, a resumed run first checkpoints the state it
           restored into DIR (to be compared with the checkpoint it resumed from); with
           $FAILURE_RAISE_STEP=K, rank 0 raises in its training step after K steps; with
           $FAILURE_DIE=R:K, rank R kills itself (SIGKILL) in its training step after K steps.

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
from typing import Any, Callable

import numpy as np

import collectives
import mpidl

comm = mpidl.init()
rank = comm.Get_rank()
mode = sys.argv[1]
#: The points of an averaging where ``trials`` kills a worker: (its side, when).
KILL_POINTS = [
    ("active", "before"),
    ("active", "during"),
    ("active", "after"),
    ("passive", "before"),
    ("passive", "during"),
]


#: The two deaths of each ``prague`` run: (whose, when), whose "service" the group
#: generator's host, "worker" another worker.
PRAGUE_PLANS = [
    [("worker", "before"), ("service", "during"), ("worker", "after")],
    [("service", "before"), ("worker", "during"), ("service", "after")],
]

#: The three deaths of each ``grsgd`` run: when, in an exchange.
GRSGD_PLANS = [["before", "during", "after"], ["after", "before", "during"]]


def announce() -> None:
    print(f"failure.py: rank {rank} {mode} at {time.time():.3f}", file=sys.stderr, flush=True)


def deaths_in_turn(
    algo: Any,
    x: np.ndarray,
    name: str,
    seed: int,
    trials: int,
    draw: Callable[[int], tuple[int, str, str, int]],
    arm: Callable[[int, str, str], None],
) -> None:
    """Step ``algo`` (learning rate 0, on ``x``; random sleeps seeded by ``seed``) until ``trials``
    workers have died one after the other, then 20 steps more, and close it. Before death K,
    ``draw(K)`` gives the victim (a world rank), two words naming its death and the step after
    which ``arm(K, *words)`` makes it die, leaving in $FAILURE_DIR/NAME-K.npy the model the
    survivors must count as its own. After each recovery the survivors settle and print
    ``failure.py: NAME SEED.K WORDS lost R error E``, E the largest difference of their sum
    from what they held less the dead worker's model."""
    rng = np.random.default_rng([11, seed, rank])
    total = algo.comm.allreduce(x)
    trial, after, seen = 0, 0, 0
    victim, first, second, arm_at = draw(trial)
    while trial < trials or after < 20:
        if rank == victim and after == arm_at:
            arm(trial, first, second)
        time.sleep(rng.uniform(0, 2e-3))
        algo.step(np.zeros_like(x))
        after += 1
        if len(algo.lost) > seen:
            algo.settle()
            survivors = algo.comm.allreduce(x)
            model = np.load(os.path.join(os.environ["FAILURE_DIR"], f"{name}-{trial}.npy"))
            error = float(np.abs(survivors - (total - model)).max())
            if algo.comm.Get_rank() == 0:
                lost = ",".join(map(str, algo.lost[seen:]))
                print(f"failure.py: {name} {seed}.{trial} {first} {second} lost {lost} error {error:.3g}", flush=True)
            total, seen, trial, after = survivors, len(algo.lost), trial + 1, 0
            if trial < trials:
                victim, first, second, arm_at = draw(trial)
    algo.close()


def dying_models(name: str, salt: int, **options: Any) -> tuple[Any, np.ndarray, Any, Callable[..., None]]:
    """For ``prague SEED`` and ``grsgd SEED`` (SEED: ``sys.argv[2]``): the algorithm ``name`` with
    ``options`` and on_failure="continue" at learning rate 0 on a random float64 model of its
    own on each worker (a stall dumps the threads' stacks after 40 s), that model, the
    generator of the run's plan (seeded by ``salt`` and SEED), and ``die(trial, point, model)``,
    which leaves in $FAILURE_DIR/NAME-TRIAL.npy the model the survivors must count as this
    worker's, and kills it."""
    import algorithms

    seed = int(sys.argv[2])
    faulthandler.dump_traceback_later(40)
    x = np.random.default_rng([7, seed, rank]).standard_normal(100)
    sgd = algorithms.SGD(x, lr=0.0)
    algo = algorithms.create(name, x, sgd, comm, broadcast_init=False, on_failure="continue", **options)
    folder = os.environ["FAILURE_DIR"]

    def die(trial: int, point: str, model: np.ndarray) -> None:
        np.save(os.path.join(folder, f"{name}-{trial}.npy"), model)
        print(f"failure.py: rank {rank} dies {point}", file=sys.stderr, flush=True)
        announce()
        os.kill(os.getpid(), signal.SIGKILL)

    return algo, x, np.random.default_rng([salt, seed]), die


if mode == "train":
    from mpidl import checkpoint, cli, train

    kill_step = int(os.environ.get("FAILURE_KILL_STEP", -1))
    raise_step = int(os.environ.get("FAILURE_RAISE_STEP", -1))
    save = checkpoint.save
    train_step = train._Run._train_step

    victim, _, die_step = os.environ.get("FAILURE_DIE", "-1:-1").partition(":")
    if int(victim) >= 0:
        faulthandler.dump_traceback_later(40)  # a hang of the survivors shows where each thread waits

    def train_step_or_raise(run: train._Run, batch: object) -> object:
        if run.step == raise_step and rank == 0:
            announce()
            raise RuntimeError("injected failure on rank 0")
        if run.step == int(die_step) and rank == int(victim):
            announce()
            os.kill(os.getpid(), signal.SIGKILL)
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

if mode == "false-alarm":
    import algorithms
    from collectives.transport import faults

    # No one dies, but the second agreement that ends a settle answers false on every rank
    # (as Open MPI's MPI_Comm_agree was seen to, docs/failures.rst): the recovery finds every
    # worker alive, and the same workers go on, on the caller's communicator.
    name = sys.argv[2]
    faulthandler.dump_traceback_later(40)
    rng = np.random.default_rng([11, rank])
    x = rng.standard_normal(100)
    total = comm.allreduce(x)
    options = {"policy": "smart"} if name == "prague" else {}
    algo = algorithms.create(
        name, x, algorithms.SGD(x, lr=0.0), comm, broadcast_init=False, on_failure="continue", **options
    )
    agree, calls = faults.agree, [0]

    def agree_falsely(c: Any, flag: bool) -> bool:
        calls[0] += 1
        return agree(c, flag) and calls[0] != 2

    faults.agree = agree_falsely
    for step in range(60):
        time.sleep(rng.uniform(0, 2e-3))
        algo.step(np.zeros_like(x))
        if step % 20 == 19:
            algo.settle()
    algo.close()
    error = float(np.abs(comm.allreduce(x) - total).max())
    same = algo.comm is comm and algo.lost == [] and algo.size == comm.Get_size()
    if rank == 0:
        print(f"failure.py: false alarm {name} agreements {calls[0]} same {same} error {error:.3g}", flush=True)
    sys.exit(0)

if mode == "survive":
    import algorithms

    victim = {"active": 0, "passive": 1}[sys.argv[2]]
    faulthandler.dump_traceback_later(40)  # a hang shows where each thread waits
    rng = np.random.default_rng([7, rank])
    x = rng.standard_normal(100)  # 800 bytes: every message is sent eagerly
    total = comm.allreduce(x)
    gossip = {"compression": sys.argv[3]} if len(sys.argv) > 3 else {}
    algo = algorithms.create(
        "adpsgd", x, algorithms.SGD(x, lr=0.0), comm, broadcast_init=False, on_failure="continue", **gossip
    )
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

if mode == "trials":
    import algorithms
    from algorithms import adpsgd
    from collectives.transport import p2p

    # Two workers of 4 die, one after the other, each at the kill point of an averaging
    # that the seed gives it (KILL_POINTS, in turns over the seeds); after each recovery
    # the survivors settle and compare their sum.
    seed = int(sys.argv[2])
    faulthandler.dump_traceback_later(40)
    x = np.random.default_rng([7, seed, rank]).standard_normal(100)
    algo = algorithms.create("adpsgd", x, algorithms.SGD(x, lr=0.0), comm, broadcast_init=False, on_failure="continue")
    plan = np.random.default_rng([13, seed])
    folder = os.environ["FAILURE_DIR"]

    def die(trial: int, point: str, model: np.ndarray) -> None:
        """Leave this worker's model as the survivors must count it, and die."""
        np.save(os.path.join(folder, f"trial-{trial}.npy"), model)
        print(f"failure.py: rank {rank} {mode} at {time.time():.3f} ({point})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def arm(trial: int, side: str, when: str) -> None:
        """Make this worker die at the point ``when`` of its next averaging."""
        point = f"{side}, {when} an averaging"
        if side == "passive" and when == "before":  # holding its lock: requests wait unanswered
            algo._lock.acquire()
            die(trial, point, x.copy())
        if side == "passive":  # during: the request received, the reply not sent

            def reply(server: adpsgd._Server, own: np.ndarray, theirs: np.ndarray, peer: int) -> None:
                die(trial, point, own.copy())

            adpsgd._Server._reply_recorded = reply  # type: ignore[method-assign]
            return
        average_with = algo._average_with

        def averaging(peer: int, step: int) -> float:
            own = algo.flat.state_data
            if when == "before":  # a neighbor chosen, nothing sent
                die(trial, point, own.copy())
            if when == "after":  # applied on both ends
                average_with(peer, step)
                die(trial, point, own.copy())
            theirs = np.empty_like(own)  # both models sent and received, the mean not applied here
            p2p.waitall([p2p.irecv(algo._comm, theirs, peer), p2p.isend(algo._comm, own, peer)])
            die(trial, point, (own + theirs) / 2)
            return 0.0

        algo._average_with = averaging  # type: ignore[method-assign]

    def draw(trial: int) -> tuple[int, str, str, int]:
        """The next victim (a world rank on the kill point's side), its kill point, and
        after how many steps it is armed."""
        side, when = KILL_POINTS[(2 * seed + trial) % len(KILL_POINTS)]
        sides = algo.topology.sides()
        assert sides is not None  # AD-PSGD's graphs are bipartite
        world = p2p.world_ranks(algo.comm)
        candidates = [world[r] for r in range(algo.size) if (sides[r] == 0) == (side == "active")]
        return candidates[int(plan.integers(len(candidates)))], side, when, int(plan.integers(5, 30))

    deaths_in_turn(algo, x, "trial", seed, 2, draw, arm)
    sys.exit(0)

if mode == "prague":
    from collectives.kernels import ring
    from collectives.transport import p2p

    seed = int(sys.argv[2])
    algo, x, plan, die = dying_models("prague", 19, policy="smart")

    def arm(trial: int, who: str, when: str) -> None:
        """Make this worker (``who``: the group generator's host or another) die at the point
        ``when`` of its next group's average."""
        preduce = algo.preduce
        run, point = preduce._run, f"{when} a group's average"

        def dying(members: tuple[int, ...]) -> None:
            if len(members) == 1:
                return run(members)
            if when == "before":  # notified of the group, nothing sent
                die(trial, point, x.copy())
            if when == "during":  # its half of the reduce-scatter sent: the average fails on both ends
                before = x.copy()

                def halfway(data: np.ndarray, group: object, red: object) -> None:
                    ring.reduce_scatter(data, group, red)  # type: ignore[arg-type]
                    die(trial, point, before)

                preduce._kernel = halfway
            run(members)
            time.sleep(0.2)  # after: the average confirmed on both ends
            die(trial, point, x.copy())

        preduce._run = dying  # type: ignore[method-assign]

    plans = PRAGUE_PLANS[seed % len(PRAGUE_PLANS)]

    def draw(trial: int) -> tuple[int, str, str, int]:
        """The next victim (a world rank: the group generator's host or a drawn other
        worker), its kill point, and after how many steps it is armed."""
        who, when = plans[trial]
        world = p2p.world_ranks(algo.comm)
        victim = world[0] if who == "service" else world[1 + int(plan.integers(len(world) - 1))]
        return victim, who, when, int(plan.integers(5, 30))

    deaths_in_turn(algo, x, "prague", seed, len(plans), draw, arm)
    sys.exit(0)

if mode == "grsgd":
    from collectives.transport import p2p

    seed = int(sys.argv[2])
    algo, x, plan, die = dying_models("grsgd", 23)

    def completes(pending: list[Any]) -> bool:
        """Whether every transfer in ``pending`` completes within a second (polled)."""
        end = time.monotonic() + 1.0
        while not p2p.test(pending):
            if time.monotonic() > end:
                return False
            time.sleep(1e-4)
        return True

    def arm(trial: int, ring: str, when: str) -> None:
        """Make this worker die at the point ``when`` of the next exchange it starts whose
        other exchanges (and for ``during`` and ``after`` its neighbor's half) complete within
        a second. Waiting longer could close a cycle of waits: its neighbor may wait, through
        the rest of the ring, for the very exchange this worker has not started yet (GR-SGD
        itself starts every idle exchange before it waits). Where they do not complete, the
        exchange goes on as usual and the next one is tried."""
        begin, point = algo._begin, f"{when} an exchange"

        def dying(peer: int, edge: Any) -> None:
            others = [started for started in algo._edges.values() if started.pending]
            if not completes([r for started in others for r in started.pending]):
                return begin(peer, edge)
            for started in others:  # no other exchange in doubt
                algo._apply(started)
            if when == "before":  # the neighbor's half may be posted; this worker's is not
                time.sleep(0.2)
                die(trial, point, x.copy())
            begin(peer, edge)
            if not completes(edge.pending):
                return
            time.sleep(0.2)  # the neighbor has applied its increment
            if when == "during":  # both snapshots exchanged, this end's increment not applied
                die(trial, point, x + algo.weight * (edge.theirs - edge.snapshot))
            algo._apply(edge)
            die(trial, point, x.copy())

        algo._begin = dying  # type: ignore[method-assign]

    plans = GRSGD_PLANS[seed % len(GRSGD_PLANS)]

    def draw(trial: int) -> tuple[int, str, str, int]:
        """The next victim (a drawn world rank of the survivors), its ring's size, its kill
        point, and after how many steps it is armed."""
        world = p2p.world_ranks(algo.comm)
        victim = world[int(plan.integers(len(world)))]
        return victim, f"ring{len(world)}", plans[trial], int(plan.integers(5, 30))

    deaths_in_turn(algo, x, "grsgd", seed, len(plans), draw, arm)
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
