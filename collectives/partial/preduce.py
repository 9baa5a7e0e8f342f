"""P-Reduce: averaging a buffer among a group of workers from the group generator.

P-Reduce (Partial All-Reduce) is an all-reduce (average) among a *group* of
ranks; the groups come from the group generator (GG) lock service of
:mod:`collectives.partial.group_generator` (rules and policies there). A Prague
worker binds its flat parameter buffer once and calls :meth:`PReduce.average`
after each local step; it returns once the buffer has been averaged with a
group that GG started after the call began.

Protocol (``random``/``smart``; ``static`` needs no messages to GG):

1. worker w sends REQUEST to GG;
2. GG answers each member of every group it starts with NOTIFY(group id,
   members, "serves your request");
3. w takes its notifications one by one, in the order GG sent them: runs
   the group's all-reduce among the members (a kernel of
   :data:`GROUP_KERNELS`, on a :class:`~collectives.partial.group_comm.GroupComm`
   of a private duplicate of the caller's communicator — no communicator is
   created per group), divides by the group size, and sends DONE(group id);
4. w returns after the group that serves its request. Groups it was drafted
   into by other workers' requests are run in step 3 on the way, with the
   same buffer; so are drafts that arrive after w's last request, in
   :meth:`PReduce.settle` and :meth:`PReduce.close`.

``settle()`` is a collective pause: each worker sends PAUSE and serves drafts
until GG, once every worker has paused and no group is active, sends QUIET
and accepts requests again. In between, every buffer is stable: a training
loop evaluates the workers' models there, or saves them with
:meth:`PReduce.state_dict` (the static schedule's position; on the service
rank the state GG had at the pause, taken by its thread before QUIET).

Where GG runs: a thread on ``service_rank`` (default 0) of the caller's own
ranks — no extra rank, so it works under a plain ``mpiexec -n N``. It talks
over a second private duplicate (its own context id), receiving REQUEST, DONE,
PAUSE and CLOSE from any source and answering with ``Isend`` so that it never
waits for a worker. It and the waiting workers poll for messages with short,
growing sleeps (:class:`~collectives.transport.p2p.Backoff`) rather than block: a
blocking MPI receive busy-waits, and would take a core from the workers
computing next to it. It handles host control messages only (buffers are
averaged on the workers' own threads), so it needs no CUDA device. Needs
``MPI_THREAD_MULTIPLE`` (mpi4py's default; refused below it, on every rank,
at construction); an exception in it ends the job
(:func:`collectives.transport.threads.start`). ``close()`` is collective: each
worker sends CLOSE and keeps serving drafts until GG, once all workers have
closed and no group is active, sends SHUTDOWN; then the thread ends and the
communicators are freed.

Why it cannot deadlock (every worker calls ``average()`` repeatedly and then
``close()``):

* A group starts only when none of its members is locked, and a member's
  lock clears only after it ran the group, so a worker is in at most one
  active group and has at most one unread notification: the one of that
  group. GG sends notifications in start order and workers read them in
  order, so a worker never waits for a group while another group it belongs
  to is pending on it (the A-waits-G1-while-drafted-into-G0 case: A reads
  G0's notification first, because GG started G0 first).
* A started group completes: each member is locked to it and reads its
  notification next, either already inside ``average()``/``close()`` or when
  it gets there; the kernel then has all its members.
* GG never blocks on a worker (it answers with ``Isend``), and it always
  returns to its ``Recv``, so workers' sends to it complete.
* Every request is served: see the fair-queue rule (random) and the
  oldest-request-leads rule (smart) in :mod:`collectives.partial.group_generator`.
* static: every worker computes the same partition for each iteration, so
  by induction on the iteration all members of each group reach it.

Cost of one P-Reduce among k ranks of an n-element buffer: two control
messages on the critical path (REQUEST, NOTIFY; DONE is not waited for) plus
the kernel on k ranks — for ring 2(k-1) alpha + 2 n (k-1)/k beta +
n (k-1)/k gamma — and n gamma for the division. Plus any queueing at GG.

A worker that dies (``on_failure="continue"``, where the MPI library has
ULFM: :mod:`collectives.transport.faults`; elsewhere a death ends the job):

* **detection**: a member of a group with it sees the group's transfers fail;
  a worker waiting for GG on the dead host sees its probe fail; GG itself
  sees any death at its next probe for messages from any worker (ULFM fails
  a wildcard receive once a failure is known). Whoever sees it revokes both
  private communicators, so every survivor's next P-Reduce call fails too.
  GG's thread ends; the survivors' waits poll (a blocked wait would end with
  a spurious error when Open MPI learns of the death late: :meth:`PReduce._failing`).
* **recovery**, in the call that failed, collective over the survivors:
  they agree and shrink the communicator, settle the group average in flight,
  and start a new GG on the survivors, on its old process if it lives, else
  on the survivors' rank 0. Lost with the old GG: its queue, locks and
  outstanding requests (every group is settled, and each survivor's
  interrupted ``average()`` returns: its next one requests anew), its
  random generator's position (the new one starts from ``seed``) and, under
  ``aware``, the measured costs (measured anew). None of it is needed for
  correctness: the invariant GG keeps (no two active groups share a worker)
  holds trivially with no group active. ``settle()`` and ``close()`` end
  with an agreement (one more collective) so that every survivor leaves them
  with the same verdict, or all recover and do it again.
* **no partial average**: before a group's all-reduce each member copies its
  buffer aside; after it, the members exchange an empty "I hold the average"
  message, and a member goes on past the group only once every other member
  said so (*confirmed*). A confirmed group is held by every member; so in a
  recovery, where some surviving member confirmed the group (it has
  confirmed one more group with each other member than they with it: the
  counts are gathered), every surviving member keeps the average, and
  otherwise every surviving member takes its copy back, none having gone
  past the group. With learning rate 0 the survivors' sum is then what they
  held less the dead worker's model (its model before the group where the
  group was taken back). Cost, in this mode only: m bytes of memory and an
  m-byte copy per averaging (less than the kernel's own reduction of m
  bytes), and one zero-byte message to and from each other member (alpha).

The static schedule cannot go on after a death (every worker must reach
each iteration's group): ``continue`` with it is refused.

Reference: Luo, He, Zhuo & Qian, "Prague: High-Performance
Heterogeneity-Aware Asynchronous Decentralized Training", ASPLOS 2020; seed
001 section 5.1.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TextIO, Union

import numpy as np
from mpi4py import MPI

from .. import validation
from ..errors import ArgumentError, CollectiveError, renamed_keyword
from ..kernels import butterfly, halving_doubling, reduce_broadcast, ring
from ..kernels.plans import Kernel
from ..topology.layout import layout as node_layout
from ..transport import faults, gpu, p2p, threads, watchdog
from ..transport.buffers import array_module, as_flat
from ..transport.context import context
from ..transport.ops import reduction
from .group_comm import GroupComm
from .group_generator import Group, GroupGenerator, check_group_size, check_policy, static_group, static_groups, workers

# Messages on the control communicator: (kind, argument) int64 pairs to GG,
# (kind, group id, serves-you flag, size, members...) to the workers.
REQUEST, DONE, CLOSE, PAUSE = 1, 2, 3, 4
NOTIFY, SHUTDOWN, QUIET = 1, 2, 3
TO_GG, TO_WORKER = 1, 2
#: The tag of a group member's "I hold the group's average" word (on_failure="continue").
COMPUTED = 0x7043

#: Environment variable that switches the GG trace on: "1" or "stderr",
#: "stdout", or a file path (appended to).
TRACE_ENV = "MPIDL_GG_TRACE"

#: The all-reduce kernels a group can run: those that need nothing but the
#: group's ranks (the topology-aware ones would need per-group communicators).
GROUP_KERNELS: dict[str, Kernel] = {
    "ring": ring.allreduce,
    "halving_doubling": halving_doubling.allreduce,
    "butterfly": butterfly.allreduce,
    "reduce_broadcast": reduce_broadcast.allreduce,
}

#: How many group adaptors a worker keeps.
_GROUP_CACHE = 256

TraceSpec = Union[None, bool, str, TextIO]


@dataclass
class PReduceStats:
    """What one worker's P-Reduce calls cost it.

    Attributes:
        calls: ``average()`` calls.
        groups: groups run, own and drafted (including during ``close()``).
        drafted: groups run that served another worker's request.
        wait_s: seconds blocked waiting for GG to start a group.
        reduce_s: seconds in the group all-reduces (under ``static`` this
            includes waiting for the group's other members).
    """

    calls: int = 0
    groups: int = 0
    drafted: int = 0
    wait_s: float = 0.0
    reduce_s: float = 0.0


class PReduce:
    """P-Reduce on one buffer: ``average()`` averages it with a group from the GG.

    Construction is collective over ``comm`` (every rank passes a buffer of
    the same length and dtype and the same options); so is :meth:`close`.
    Usable as a context manager that closes on exit (not when an exception
    leaves the block: it may be this rank's alone, and closing would wait for
    the other ranks before it is printed).

    Args:
        buf: the buffer to average (any buffer :func:`~collectives.as_flat`
            accepts; floating-point). It stays bound: every ``average()``
            overwrites it in place, and drafts run on it too.
        comm: the workers (default ``MPI.COMM_WORLD``).
        group_size: members per group, 1..comm size (default: pairs, or 1
            on a single rank).
        policy: "random", "smart", "aware" or "static" (see
            :mod:`collectives.partial.group_generator`).
        period: static only: iterations a partition is kept before it rotates.
        cross_every: aware only: every how many groups a worker crosses nodes.
        seed: seed of the random draws / the static schedule (>= 0).
        collective: the all-reduce algorithm run within a group, a name in
            :data:`GROUP_KERNELS`.
        algorithm: the old name of ``collective`` (deprecated).
        service_rank: the rank whose thread runs GG.
        trace: GG trace: True/"stderr", "stdout", a file path, an open text
            stream, or False; None reads ``MPIDL_GG_TRACE``. Opened and
            written by ``service_rank`` only.
        validate: check the arguments agree across ranks (None reads
            ``MPIDL_VALIDATE``, default on).
        on_failure: "abort" (a worker's death ends the job) or "continue"
            (the survivors go on, where the MPI library has ULFM; elsewhere
            rank 0 warns that it has not, and a death ends the job; module
            docstring). Not with ``static``.
        exchange: what a group does to the bound buffer instead of averaging it: called
            as ``exchange(members, group)`` on every member, with the members' ranks
            (ascending, this rank included) and a :class:`~collectives.partial.group_comm.GroupComm`
            of them, it must leave the buffer as the exchange makes it (Prague's compressed
            gossip: :mod:`algorithms.prague`); None: the group's mean. Not with
            ``on_failure="continue"`` (the buffer alone could not be taken back).

    Attributes:
        comm: the workers' communicator: ``comm``, or after a death the survivors'.
        rank, size: this worker's rank in it, and its size.
        lost: the ``MPI_COMM_WORLD`` ranks of the workers that died.
        survives: whether a worker's death leaves the others averaging.
        stats: :class:`PReduceStats`.
        last_group: the members of the group that served the last ``average()``.

    Raises:
        ArgumentError: bad or disagreeing arguments, or a trace file that
            ``service_rank`` cannot open, on every rank.
    """

    def __init__(
        self,
        buf: Any,
        comm: MPI.Comm | None = None,
        *,
        group_size: int | None = None,
        policy: str = "random",
        period: int = 1,
        cross_every: int = 2,
        seed: int = 0,
        collective: str = "ring",
        service_rank: int = 0,
        trace: TraceSpec = None,
        validate: bool | None = None,
        algorithm: str | None = None,
        on_failure: str = "abort",
        exchange: Callable[[tuple[int, ...], GroupComm], None] | None = None,
    ) -> None:
        collective = renamed_keyword("PReduce", "algorithm", "collective", algorithm, collective, "ring")
        user = MPI.COMM_WORLD if comm is None else comm
        ctx = context(user)
        self.rank, self.size = ctx.rank, ctx.size
        if group_size is None:
            group_size = min(2, self.size)
        options = (
            f"group_size={group_size} policy={policy} period={period} cross_every={cross_every} "
            f"seed={seed} service_rank={service_rank} on_failure={on_failure}"
        )
        problem = None
        try:
            self._flat = as_flat(buf)
            self._on_host = type(self._flat.data) is np.ndarray
            self._red = reduction("avg", self._flat.dtype, array_module(self._flat.data))
            self._kernel = check_options(
                self.size, collective, policy, group_size, period, seed, service_rank, cross_every, on_failure
            )
            if exchange is not None and on_failure == "continue":
                raise ArgumentError(
                    "PReduce: an exchange other than the mean cannot be taken back after a death: "
                    "on_failure='continue' needs exchange=None"
                )
        except ArgumentError as exc:
            problem = exc
        if validation.enabled(validate):
            dtype = "" if problem else self._flat.dtype + ("" if self._on_host else " (device)")
            signature = (
                (0, 0, 0, 0, 0)
                if problem
                else (
                    self._flat.size,
                    validation.code(dtype),
                    validation.code("avg"),
                    validation.code(collective),
                    validation.code(options),
                )
            )
            validation.check(
                ctx,
                "PReduce",
                problem,
                signature,
                lambda: (
                    {},
                    {validation.code(dtype): dtype},
                    {},
                    {validation.code(a): a for a in GROUP_KERNELS},
                    {validation.code(options): options},
                ),
                fields=("length", "dtype", "op", "collective", "options"),
            )
        elif problem:
            raise problem
        if not self._on_host:
            gpu.ensure(ctx.comm, self._flat)
        self.group_size, self.policy, self.period, self.seed = int(group_size), policy, period, seed
        self.cross_every = cross_every
        self._exchange = exchange
        self.survives = faults.survival(on_failure, "P-Reduce", self.rank)
        self.comm: MPI.Comm = user
        self.lost: list[int] = []
        self.stats = PReduceStats()
        self.last_group: tuple[int, ...] | None = None  # the group that served the last average()
        self._iteration = 0
        self._closed = False
        self._trace_spec = trace
        self._inbox = np.zeros(4 + self.group_size, np.int64)
        self._outbox = np.zeros(2, np.int64)
        self._thread: threading.Thread | None = None
        self._service: _Service | None = None
        self._stalled: watchdog.Reporter | None = None
        # Where a worker's death is survived: the buffer before the exchange in flight, that
        # exchange's members (world ranks) until every member is known to hold its average,
        # and the exchanges so confirmed with each other worker (world rank).
        self._pre = array_module(self._flat.data).empty_like(self._flat.data) if self.survives else None
        self._pending: tuple[int, ...] | None = None
        self._confirmed: dict[int, int] = {}
        self._connect(ctx.comm, user, service_rank)

    def _connect(self, comm: MPI.Comm, user: MPI.Comm, service_rank: int) -> None:
        """Set up the private communicators (duplicates of ``comm``) and, on
        ``service_rank``, the group generator's thread (collective over ``comm``;
        ``user``: the caller's communicator, whose node layout the aware policy reads)."""
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._service_rank = service_rank
        self._groups: dict[tuple[int, ...], GroupComm] = {}
        self._trace = _open_trace(comm, self._trace_spec, service_rank)
        self._data = faults.returning(comm.Dup()) if self.survives else comm.Dup()
        self._world = p2p.world_ranks(self._data)
        if self.policy == "static":
            return
        self._ctl = faults.returning(comm.Dup()) if self.survives else comm.Dup()
        nodes = node_layout(user).node_of if self.policy == "aware" else None  # collective on first use
        if self.rank == service_rank:
            gg = GroupGenerator(
                self.size,
                min(self.group_size, self.size),
                self.policy,
                seed=self.seed,
                nodes=nodes,
                cross_every=self.cross_every,
                trace=self._trace.write if self._trace else None,
            )
            self._service = _Service(self._ctl, gg, self._trace, (self._ctl, self._data) if self.survives else ())
            self._trace = None  # the service owns it now
            self._thread = threads.start(self._service.run, "mpidl-group-generator")
            self._stalled = gg.stalled
            watchdog.add_reporter(self._stalled)

    def average(self) -> Any:
        """Average the bound buffer with a group from the GG, in place, and return it.

        Blocks until a group containing this rank, started after the call,
        has run; groups this rank was drafted into before that run first. On
        return the buffer holds the mean of the members' buffers, bitwise the
        same on every member.
        """
        if self._closed:
            raise CollectiveError("PReduce.average() after close()")
        if self.policy == "static":
            members = static_group(self.rank, self._iteration, self.size, self.group_size, self.period, self.seed)
            if self._trace is not None and self._iteration % self.period == 0:
                period = self._iteration // self.period
                groups = static_groups(self.size, self.group_size, period, self.seed)
                self._trace.write(
                    f"[static] iteration {self._iteration}, period {period}: " + " ".join(map(workers, groups))
                )
            self._iteration += 1
            self._run(members)
            self.stats.groups += 1
            self.last_group = members
        else:
            try:
                with self._failing():
                    self._tell(REQUEST)
                    while True:
                        served = self._serve()
                        if served is None:
                            raise CollectiveError("the group generator stopped with a request outstanding")
                        if served:
                            break
            except faults.PeerFailure:
                self._recover()
        self.stats.calls += 1
        return self._flat.owner

    def settle(self) -> None:
        """Collectively pause: serve drafts until every rank has called ``settle()``
        and no group is running or queued; then return (every rank's buffer is
        stable until its next ``average()``). Nothing to wait for under ``static``.
        """
        if self._closed:
            raise CollectiveError("PReduce.settle() after close()")
        if self.policy != "static":
            self._until_all(PAUSE, "settle")

    def state_dict(self) -> dict[str, Any]:
        """What the next ``average()`` depends on besides the buffer, after
        :meth:`settle` (JSON-able): ``iteration``, the averagings so far under
        ``static`` (the schedule's position), and on the service rank
        ``generator``, GG's state at the last pause."""
        state: dict[str, Any] = {"iteration": self._iteration}
        if self._service is not None:
            state["generator"] = self._service.paused
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, a :meth:`state_dict` of the same configuration and
        rank: on every rank before any rank's next ``average()`` (local)."""
        self._iteration = int(state["iteration"])
        if self._service is not None:
            if "generator" not in state:
                raise ArgumentError("the state of the service rank holds no group generator state")
            self._service.gg.load_state_dict(state["generator"])
            self._service.paused = state["generator"]

    def close(self) -> None:
        """Collectively stop: serve remaining drafts, stop GG, free the communicators.

        Every rank must call it once it will call ``average()`` no more; it
        returns when all ranks have. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if self.policy != "static":
            self._until_all(CLOSE, "close")
            if self._thread is not None:
                self._thread.join()
            if self._stalled is not None:  # its stalls are over only now
                watchdog.remove_reporter(self._stalled)
            self._ctl.Free()
        elif self._trace is not None:
            self._trace.close()
        self._data.Free()

    def __enter__(self) -> PReduce:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        # Another exception may be this rank's alone: the collective close() would wait for the
        # others. An ArgumentError is raised on every rank alike: they close together.
        if kind is None or issubclass(kind, ArgumentError):
            self.close()

    def _until_all(self, kind: int, call: str) -> None:
        """Send PAUSE or CLOSE (``kind``) and serve drafts until GG answers QUIET or
        SHUTDOWN. Where a worker's death is survived, the workers then agree whether
        one died (so that all leave the call, or none: the others would wait for those
        gone in the recovery) and, if so, recover and do it again among the survivors."""
        while True:
            ended = True
            try:
                with self._failing():
                    self._tell(kind)
                    while self._serve(call) is not None:
                        pass
            except faults.PeerFailure:
                ended = False
            if not self.survives:
                return
            with p2p.waiting(self._ctl):
                if faults.agree(self._ctl, ended):
                    return
            self._recover(agreed=True)

    def _failing(self) -> AbstractContextManager:
        """Where a worker's death is survived: a block whose failed transfers revoke both
        private communicators and raise :class:`~collectives.transport.faults.PeerFailure`,
        its waits polling (:func:`~collectives.transport.faults.failing`)."""
        return faults.failing((self._ctl, self._data), self.survives)

    def _recover(self, agreed: bool = False) -> None:
        """After a peer failed (collective over the survivors; module docstring): stop the
        group generator, agree (unless the caller did), shrink, settle the exchange that
        the failure interrupted, and start over on the survivors, the group generator on
        its old process if it survived, else on the survivors' rank 0."""
        old = (self._ctl, self._data)
        for comm in old:
            faults.revoke(comm)  # where this worker saw it first: the group generator stops too
        if self._thread is not None:
            self._thread.join()
        if self._stalled is not None:
            watchdog.remove_reporter(self._stalled)
        self._thread = self._service = self._stalled = None
        survivors, lost = faults.recover(self._ctl, "P-Reduce", agreed)
        self._reconcile(survivors)
        service = self._world[self._service_rank]
        for comm in old:
            comm.Free()
        world = p2p.world_ranks(survivors)
        if not lost:  # a false alarm (faults.false_alarm): the same workers, on the caller's communicator
            self._connect(survivors, self.comm, world.index(service))
            survivors.Free()
            faults.false_alarm("P-Reduce", self.rank)
            return
        self.lost += lost
        self.comm = survivors
        self._connect(survivors, survivors, world.index(service) if service in world else 0)
        if self.rank == 0:
            moved = "" if service in world else f", restarted on rank {world[0]} of MPI_COMM_WORLD"
            faults.warn(
                f"P-Reduce: worker(s) {', '.join(map(str, lost))} of MPI_COMM_WORLD failed; {self.size} continue "
                f"with a new group generator{moved}"
            )

    def _reconcile(self, survivors: MPI.Intracomm) -> None:
        """Make the survivors of the exchange in flight keep its average or all take it back
        (collective over ``survivors``): a member that confirmed it (every member said it
        holds the average) has confirmed one more exchange with each of the others than they
        have with it; where no survivor did, each member restores its buffer from before."""
        me, world = self._world[self.rank], p2p.world_ranks(survivors)
        counts = np.zeros(MPI.COMM_WORLD.Get_size(), np.int64)
        for peer, n in self._confirmed.items():
            counts[peer] = n
        table = np.empty((len(world), counts.size), np.int64)
        blocking = p2p.poll_waits(True)  # not a blocking wait (_failing)
        try:
            with p2p.waiting(survivors):
                p2p.complete(survivors.Iallgather(counts, table))
        finally:
            p2p.poll_waits(blocking)
        views = dict(zip(world, table))
        members, self._pending = self._pending, None
        if members is None:
            return
        kept = any(views[m][me] > counts[m] for m in members if m != me and m in views)
        if not kept:
            array_module(self._flat.data).copyto(self._flat.data, self._pre)

    def _confirm(self, members: tuple[int, ...]) -> None:
        """Tell the other ``members`` that this worker holds the group's average, and wait
        until each has said so (on_failure="continue": then the exchange is confirmed)."""
        others = tuple(m for m in members if m != self.rank)
        word = np.empty(0, np.uint8)
        pending = [self._data.Irecv([word, MPI.BYTE], m, COMPUTED) for m in others]
        pending += [self._data.Isend([word, MPI.BYTE], m, COMPUTED) for m in others]
        with faults.revoking((self._ctl, self._data), pending):
            p2p.waitall(pending, self._data, others)
        for m in others:
            world = self._world[m]
            self._confirmed[world] = self._confirmed.get(world, 0) + 1
        self._pending = None

    def _serve(self, call: str = "average") -> bool | None:
        """Run the next group GG notified: True if it served this rank's request,
        None on SHUTDOWN or QUIET. ``call``: the method waiting (for the stall inspector)."""
        t = time.perf_counter()
        p2p.operation(
            f"P-Reduce (waiting for a group from the group generator on rank {self._service_rank})"
            if call == "average"
            else f"P-Reduce {call}() (waiting for every worker's {call}() at the group generator "
            f"on rank {self._service_rank})"
        )
        blocked = p2p.watch(self._ctl, (self._service_rank,))
        try:
            backoff = p2p.Backoff()
            while not self._ctl.Iprobe(self._service_rank, TO_WORKER):
                backoff.sleep()
            self._ctl.Recv([self._inbox, MPI.INT64_T], self._service_rank, TO_WORKER)
        finally:
            blocked.since = 0.0
        self.stats.wait_s += time.perf_counter() - t
        kind, gid, serves, size = (int(v) for v in self._inbox[:4])
        if kind in (SHUTDOWN, QUIET):
            return None
        members = tuple(int(m) for m in self._inbox[4 : 4 + size])
        p2p.operation(f"P-Reduce (group {gid} of ranks {list(members)})")
        self._run(members)
        self._tell(DONE, gid)
        self.stats.groups += 1
        if serves:
            self.last_group = members
        else:
            self.stats.drafted += 1
        return bool(serves)

    def _run(self, members: tuple[int, ...]) -> None:
        """Average the buffer among ``members`` (parent ranks, ascending, self included)."""
        t = time.perf_counter()
        if len(members) > 1 and self._flat.size:
            data = self._flat.data
            if self._pre is not None:  # a worker's death is survived: keep what the exchange may take back
                array_module(data).copyto(self._pre, data)
                self._pending = tuple(self._world[m] for m in members)
            if self._exchange is not None:
                self._exchange(members, self._group(members))
            else:
                self._kernel(data, self._group(members), self._red)  # type: ignore[arg-type]  # GroupComm: the kernels' subset of a Comm
                self._red.finalize(data, len(members))
            if self._pre is not None:
                self._confirm(members)
        self.stats.reduce_s += time.perf_counter() - t

    def _group(self, members: tuple[int, ...]) -> GroupComm:
        group = self._groups.get(members)
        if group is None:
            if len(self._groups) >= _GROUP_CACHE:
                del self._groups[next(iter(self._groups))]
            group = self._groups[members] = GroupComm(self._data, members)
        return group

    def _tell(self, kind: int, arg: int = 0) -> None:
        self._outbox[0], self._outbox[1] = kind, arg
        p2p.complete(self._ctl.Isend([self._outbox, MPI.INT64_T], self._service_rank, TO_GG))


def check_options(
    size: int,
    collective: str,
    policy: str,
    group_size: int,
    period: int,
    seed: int,
    service_rank: int,
    cross_every: int = 2,
    on_failure: str = "abort",
) -> Kernel:
    """Raise ArgumentError for a bad option, or for a policy whose group generator
    needs a thread level MPI does not provide; return the kernel of ``collective``."""
    kernel = GROUP_KERNELS.get(collective)
    if kernel is None:
        raise ArgumentError(f"unknown collective {collective!r}; valid for groups: {', '.join(GROUP_KERNELS)}")
    check_policy(policy)
    check_group_size(group_size, size)
    for name, value, low in (("period", period, 1), ("seed", seed, 0), ("cross_every", cross_every, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ArgumentError(f"{name} must be an integer >= {low}, got {value!r}")
    if isinstance(service_rank, bool) or not isinstance(service_rank, int) or not 0 <= service_rank < size:
        raise ArgumentError(f"service_rank must be a rank in 0..{size - 1}, got {service_rank!r}")
    if on_failure not in faults.ON_FAILURE:
        raise ArgumentError(f"unknown on_failure {on_failure!r}; valid: {', '.join(faults.ON_FAILURE)}")
    if on_failure == "continue" and policy == "static":
        raise ArgumentError(
            "on_failure='continue' needs groups from the group generator (policy random, smart or aware): "
            "the static schedule needs every worker to average in step, which a death breaks"
        )
    if policy != "static":
        threads.require_multiple(f"P-Reduce's group generator (policy {policy!r}) runs on a service thread")
    return kernel


def _open_trace(comm: MPI.Comm, spec: TraceSpec, service_rank: int) -> _Trace | None:
    """The GG trace of ``spec`` on ``service_rank``, None elsewhere (collective: a trace
    that cannot be opened raises ArgumentError on every rank)."""
    trace, problem = None, None
    if comm.Get_rank() == service_rank:
        try:
            trace = _Trace.open(spec)
        except OSError as exc:
            source = f" (from {TRACE_ENV})" if spec is None else ""
            problem = f"{exc.filename!r}{source}: {exc.strerror}"
    problem = comm.bcast(problem, root=service_rank)
    if problem is not None:
        raise ArgumentError(f"PReduce: rank {service_rank} cannot open the group generator's trace file {problem}")
    return trace


class _Service:
    """The GG thread: receives workers' messages, feeds the state machine, notifies members."""

    def __init__(
        self, ctl: MPI.Comm, gg: GroupGenerator, trace: _Trace | None, revoked: tuple[MPI.Comm, ...] = ()
    ) -> None:
        self.ctl, self.gg, self.trace, self.revoked = ctl, gg, trace, revoked
        self.sends: list[tuple[MPI.Request, np.ndarray]] = []  # notifications in flight, with their buffers
        self.paused = gg.state_dict()  # GG's state at the last pause (or the start)

    def run(self) -> None:
        """The thread (an exception ends the job: it would hang every worker). Where a
        worker's death is survived (``revoked``: the communicators to revoke), an MPI
        error of a dead peer or a revoked communicator revokes them and ends the thread
        quietly: the workers recover (:meth:`PReduce._recover`)."""
        try:
            self._loop()
        except MPI.Exception as exc:
            if not (self.revoked and faults.is_failure(exc)):
                raise
            for comm in self.revoked:
                faults.revoke(comm)
            faults.drain([r for r, _ in self.sends])
        finally:
            if self.trace is not None:
                self.trace.close()

    def _loop(self) -> None:
        gg, ctl = self.gg, self.ctl
        msg = np.zeros(2, np.int64)
        status = MPI.Status()
        backoff = p2p.Backoff()
        pausing: set[int] = set()  # workers that sent PAUSE, not CLOSE
        while True:
            if ctl.Iprobe(MPI.ANY_SOURCE, TO_GG, status):
                backoff.reset()
                ctl.Recv([msg, MPI.INT64_T], status.Get_source(), TO_GG)
                started = self._handle(int(msg[0]), int(msg[1]), status.Get_source(), pausing)
            else:
                started = gg.tick()  # an aware leader that has waited long enough
                if not started:
                    backoff.sleep()
                    continue
            for group in started:
                for m in group.members:
                    self._send(m, NOTIFY, group.gid, m in group.served, group.members)
            if gg.finished:
                if pausing and len(pausing) != gg.n:
                    raise CollectiveError(
                        f"group generator: ranks {sorted(pausing)} called settle() while the others called close()"
                    )
                if pausing:
                    self.paused = gg.state_dict()  # before QUIET: a settled worker may read it
                for w in range(gg.n):
                    self._send(w, QUIET if pausing else SHUTDOWN)
                if not pausing:
                    break
                gg.reopen()
                pausing.clear()
            self.sends = [s for s in self.sends if not s[0].Test()]
        MPI.Request.Waitall([r for r, _ in self.sends])

    def _handle(self, kind: int, arg: int, worker: int, pausing: set[int]) -> list[Group]:
        """Feed one worker's message to GG; the groups it started."""
        if kind == REQUEST:
            return self.gg.request(worker)
        if kind == DONE:
            return self.gg.done(worker, arg)
        if kind in (CLOSE, PAUSE):
            if kind == PAUSE:
                pausing.add(worker)
            return self.gg.close(worker)
        raise CollectiveError(f"group generator: unknown message kind {kind} from rank {worker}")

    def _send(self, worker: int, kind: int, gid: int = 0, serves: bool = False, members: tuple[int, ...] = ()) -> None:
        """Start sending a message to ``worker``; it is completed later (GG never waits for a worker)."""
        out = np.zeros(4 + self.gg.group_size, np.int64)
        out[:4] = kind, gid, serves, len(members)
        out[4 : 4 + len(members)] = members
        self.sends.append((self.ctl.Isend([out, MPI.INT64_T], worker, TO_WORKER), out))


class _Trace:
    """Where trace lines go (one thread writes): a stream, flushed per line; a file it opened is closed by close()."""

    def __init__(self, stream: TextIO, owned: bool) -> None:
        self.stream, self.owned = stream, owned

    @classmethod
    def open(cls, spec: TraceSpec) -> _Trace | None:
        """The trace for ``spec`` (see :class:`PReduce`), or None when off."""
        if spec is None:
            spec = os.environ.get(TRACE_ENV, "")
        if spec is False or (isinstance(spec, str) and spec.strip().lower() in ("", "0", "false", "no", "off")):
            return None
        if spec is True or (isinstance(spec, str) and spec.strip().lower() in ("1", "true", "yes", "on", "stderr")):
            return cls(sys.stderr, False)
        if isinstance(spec, str) and spec.strip().lower() == "stdout":
            return cls(sys.stdout, False)
        if isinstance(spec, str):
            return cls(open(spec, "a", encoding="utf-8"), True)
        return cls(spec, False)

    def write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.owned:
            self.stream.close()
