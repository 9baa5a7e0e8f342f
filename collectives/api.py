"""The all-reduce entry point, the registry of its algorithms (collectives), and ``auto``.

A call's arguments (communicator, algorithm, op, dtype, length, memory,
options, validation) are resolved once into a :class:`_Call` — the
reduction, the argument signature, the plan — cached on the communicator's
context, so a repeated call costs a few dictionary lookups before data moves;
a call that repeats the previous one's objects (the same host array,
communicator and argument objects) skips even those (:data:`_last`).
The call checks the arguments across ranks (:mod:`collectives.validation`)
and runs a *plan*: the algorithm bound to the communicators it needs. Plans
are built once per (communicator, algorithm, layout, grid), after a check has
passed (building may create sub-communicators, allocate shared memory or
calibrate the cost model: collective), so nothing of the kind happens per call.

Once the plan exists the check rides with the data where it can: in the
shared segment when the shared-memory algorithm runs on one node, in the
messages of small butterfly all-reduces on communicators that span nodes of
one rank each, with small shared-memory all-reduces through the check's
own stages where nodes hold several ranks, and across nodes in the MPI
library's own call of a short "mpi" all-reduce that repeats the expected
call (:mod:`collectives.validation`).
Which way a call goes depends only on what every rank built together (the
plans, and ``auto``'s choice per size), never on the resolved calls a rank
happens to keep: a call is bound as soon as its plan exists, so ranks whose
kept calls differ (after a call that failed on some ranks, or after one rank
dropped its calls at :data:`_CALLS`) still take the same path.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import time
import weakref
from collections.abc import Hashable
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from . import validation
from .errors import ArgumentError, renamed_keyword
from .kernels import native, reduce_broadcast, shm
from .kernels.plans import PLANNERS, Native, Request, Run, Shm
from .topology import hierarchy
from .topology.layout import Layout, RanksPerNode
from .topology.layout import layout as node_layout
from .transport import gpu, p2p
from .transport.buffers import DTYPE_CODES, FlatBuffer, array_module, as_flat, dtype_code, host_view
from .transport.context import Context, context
from .transport.ops import OPS, Reduction, reduction
from .tuning import calibration, costmodel
from .tuning.costmodel import Choice
from .tuning.online import Session
from .tuning.selector import Selector
from .tuning.watch import Watch

log = logging.getLogger("collectives.auto")


class _Auto:
    """The "auto" plan: per size, memory and dtype, the algorithm measured fastest on this
    communicator (:mod:`collectives.tuning.selector`: calibration where the sizes are,
    the persisted cache, online tuning), or with ``MPIDL_COSTMODEL`` the cost model's."""

    def __init__(self, req: Request) -> None:
        comm, lay = req.comm, node_layout(req.comm, req.layout)
        self.selector = Selector(req, lay, lambda xp: _params(comm, lay, req.ctx, xp))
        self.chosen: dict[tuple[int, Any, bool, bool], tuple[str, Watch | None]] = {}
        self.tuning: dict[tuple[int, Any, bool, bool], Session] = {}

    def decided(self, x: Any, red: Reduction, validate: bool) -> bool:
        """Whether the algorithm for ``x`` (size, memory, dtype) is chosen already (local)."""
        return _key(x, red, validate) in self.chosen

    def resolve(self, x: Any, red: Reduction, validate: bool) -> tuple[str | None, Run, Watch | None]:
        """The algorithm for ``x``, its plan and the watch on it (None where the choice is
        not watched), chosen once per case (logged at DEBUG) and again after a drift
        (while the watch probes a rival, the rival);
        while the size band is tuned online, (None, the tuning, None) runs the call
        instead. Collective where it measures, loads, tunes or watches (:class:`Selector`)."""
        key = _key(x, red, validate)
        chosen = self.chosen.get(key)
        if chosen is None:
            session = self.tuning.get(key)
            if session is not None:
                if session.result is None:
                    return None, session, None
                del self.tuning[key]
            _, xp, _, dtype_ok = key
            choice = self.selector.choose(x.nbytes, xp, validate, dtype_ok)
            log.debug("%s", choice.reason)
            session = self.selector.session(choice, xp, dtype_ok)
            if session is not None and not session.deterministic:
                self.tuning[key] = session
                return None, session, None
            watch = None
            if session is not None:  # no watch: its rehearsed window would time again what was just timed
                session.rehearse(x, red)
                choice = self.selector.choose(x.nbytes, xp, validate, dtype_ok)
                log.debug("%s", choice.reason)
            else:
                choice, watch = self.selector.watch(choice, xp, validate, dtype_ok, x, red)
            if watch is not None:
                watch.on_drift = functools.partial(self.drifted, key, watch)
            chosen = self.chosen[key] = choice.algorithm, watch
        name, watch = chosen
        if watch is not None:  # the watch's choice, or its rival while probed
            name = watch.running
        return name, self.selector.runs[name], watch

    def explain(self, nbytes: int, xp: Any, validate: bool, dtype_ok: bool) -> Choice:
        """What :meth:`resolve` runs for ``nbytes`` of ``xp`` memory (:meth:`Selector.choose`,
        or where a watch's rival took the choice's place on real calls, the rival)."""
        choice = self.selector.choose(nbytes, xp, validate, dtype_ok)
        _, watch = self.chosen.get((nbytes, xp, validate, dtype_ok), (None, None))
        if watch is None or watch.chosen == choice.algorithm:
            return choice
        return dataclasses.replace(
            choice, algorithm=watch.chosen, reason=f"{choice.reason}; {watch.story}", source="watch"
        )

    def drifted(self, key: tuple[int, Any, bool, bool], watch: Watch, seconds: float) -> None:
        """``watch`` found its choice (of ``key``) taking ``seconds`` a call, beyond what
        was expected: forget both, so the next call of ``key`` chooses anew (every rank
        learns it at the same call, :mod:`collectives.tuning.watch`)."""
        del self.chosen[key]
        self.selector.forget(key[0], key[1], watch.chosen, watch.expected, seconds)

    def free(self) -> None:
        """Persist what was measured and tuned (:meth:`Selector.save`)."""
        self.selector.save()


#: Registered all-reduce algorithms (``collective=`` of the entry points): name -> planner.
COLLECTIVES: dict[str, Callable[[Request], Any]] = {**PLANNERS, "auto": _Auto}

DEFAULT_COLLECTIVE = "auto"
_FIELDS = ("length", "dtype", "op", "collective", "options")  # the all-reduce's signature, for its errors
_WORLD = MPI.COMM_WORLD
_CALLS = 512  # resolved calls kept per communicator
# The last host all-reduce's arguments and resolved call: a call that repeats them
# (the same array object, communicator, strings and flags, by identity; the array's
# dtype, shape and flags unchanged) skips the entry point's look-ups. The array is
# held weakly; a freed communicator's calls are never reused.
_last: tuple[Any, ...] | None = None


class _Call:
    """One all-reduce call's arguments on one communicator, resolved.

    Built locally (no communication): raises ArgumentError for a bad op,
    algorithm, layout or grid. The plan is bound when a run starts and finds it
    built (:meth:`find`), else after the check, collectively (:meth:`bind`),
    with the way the check can ride along from then on.
    """

    __slots__ = (
        "agreed",
        "algorithm",
        "average",
        "carrier",
        "ctx",
        "fuse",
        "header",
        "native",
        "operation",
        "plan",
        "red",
        "request",
        "run",
        "signature",
        "validate",
        "version",
        "watch",
    )

    def __init__(
        self,
        ctx: Context,
        comm: MPI.Comm,
        algorithm: str,
        op: str,
        flat: FlatBuffer,
        layout: RanksPerNode,
        grid: tuple[int, int] | None,
        validate: bool,
    ) -> None:
        if algorithm not in COLLECTIVES:
            raise ArgumentError(f"unknown collective {algorithm!r}; valid collectives: {', '.join(COLLECTIVES)}")
        self.red = reduction(op, flat.dtype, array_module(flat.data))
        if algorithm == "mpi" and native.unsupported(flat.dtype, op):
            raise ArgumentError(str(native.unsupported(flat.dtype, op)))
        if layout is not None:
            node_layout(comm, layout)  # an override is parsed locally: no communication
        if grid is not None:
            hierarchy.check_grid(grid, comm.Get_size())
        options = 0 if layout is None and grid is None else validation.code(repr((layout, grid)))
        self.ctx, self.algorithm, self.validate = ctx, algorithm, validate
        self.request = Request(comm, ctx, layout, grid)
        self.plan = _plan_key(algorithm, layout, grid)
        self.signature = (flat.size, dtype_code(flat), validation.code(op), validation.code(algorithm), options)
        self.header = validation.header(None, self.signature)
        self.agreed = self.header * ctx.size  # every rank's header when all agree
        self.operation = f"allreduce(collective={algorithm!r})"
        self.average = op == "avg"
        self.run: Run | None = None
        self.carrier: shm.Carried | None = None
        self.fuse = self.native = False
        self.watch: Watch | None = None
        self.version = 0  # the watch's, when bound

    def __call__(self, x: Any) -> None:
        """All-reduce the flat array ``x`` in place (finished, e.g. averaged)."""
        watch = self.watch
        if self.run is None or (watch is not None and watch.version != self.version):
            self.find(x)
            watch = self.watch
        start = 0.0 if watch is None else time.perf_counter()
        carrier, red = self.carrier, self.red
        if carrier is not None:  # the check rides in the shared segment
            carrier(x)
        elif (
            not self.validate
            or not validation.check(
                self.ctx,
                "allreduce",
                None,
                self.signature,
                _field_names,
                x if self.fuse else None,
                red,
                _FIELDS,
                self.native,
            )
        ) and x.shape[0]:  # the data moves unless the check already carried it
            if type(x) is not np.ndarray:
                gpu.ensure(self.ctx.comm, FlatBuffer(x, red.dtype, x))
            (self.run or self.bind(x))(x, red)
        if watch is not None:
            watch.record(time.perf_counter() - start)
        if self.average:
            red.finalize(x, self.ctx.size)

    def verify(self, seg: shm.Segment) -> None:
        """The check riding in the shared segment: every rank's header against this one."""
        headers = seg.headers()
        if headers != self.agreed:
            validation.verify(self.ctx, "allreduce", None, self.signature, _field_names, headers, _FIELDS)

    def find(self, x: Any) -> None:
        """Bind locally (no communication) if the plan, and for "auto" the algorithm
        chosen for ``x``'s size and memory, exist already.

        Plans and auto's choices are only ever added, and only collectively
        (:meth:`bind`, after a passed check), and a watch changes what auto runs
        at the same call on every rank (from agreed times), so whether a call is
        bound when it starts, and with it the way its check goes, is the same on
        every rank, whatever resolved calls each rank has kept (:data:`_CALLS`).
        """
        if self.watch is not None:  # the watch moved on: the binding is dropped, auto binds anew
            self.run, self.carrier, self.fuse, self.native, self.watch = None, None, False, False, None
        plan = self.ctx.cache.get(self.plan)
        if plan is not None and (not isinstance(plan, _Auto) or plan.decided(x, self.red, self.validate)):
            self.bind(x)

    def bind(self, x: Any) -> Run:
        """Find (or build, collectively) the plan, and note how the check can ride along."""
        ctx = self.ctx
        plan = ctx.cache.get(self.plan)
        if plan is None:
            plan = ctx.cache[self.plan] = COLLECTIVES[self.algorithm](self.request)
        name, run = self.algorithm, plan
        if isinstance(plan, _Auto):
            chosen, run, watch = plan.resolve(x, self.red, self.validate)
            if chosen is None:  # tuned online: this call runs a candidate, and stays unbound
                return run
            name, self.watch = chosen, watch
            self.version = 0 if watch is None else watch.version
            self.operation = f"allreduce(collective='auto': {name!r})"  # what the stall inspector names
            p2p.operation(self.operation)
        if self.validate and type(x) is np.ndarray and ctx.size > 1:
            seg = run.carrier(ctx) if isinstance(run, Shm) else None
            self.carrier = (
                None if seg is None else shm.Carried(seg, x.shape[0], x.dtype, self.red, self.header, self.verify)
            )
            self.fuse = _rides_check(ctx, name, run, x)
            self.native = self.fuse and isinstance(run, Native)
        self.run = run
        return run


def allreduce(
    buf: Any,
    comm: MPI.Comm | None = None,
    op: str = "sum",
    collective: str = DEFAULT_COLLECTIVE,
    *,
    validate: bool | None = None,
    layout: RanksPerNode = None,
    grid: tuple[int, int] | None = None,
    algorithm: str | None = None,
) -> Any:
    """Reduce ``buf`` element-wise across all ranks of ``comm``, in place, and return it.

    Args:
        buf: a C-contiguous, writable numpy array or torch tensor of any
            shape, dtype one of float16, bfloat16 (torch), float32, float64,
            int32, int64 (numpy subclasses such as ``np.memmap`` and
            ``np.matrix`` too; masked arrays are refused). Overwritten with
            the reduction over all ranks; every rank ends with
            bitwise-identical contents.
        comm: the communicator (default ``MPI.COMM_WORLD``). Every rank of it
            must call with the same length, dtype, op, collective and options.
        op: one of "sum", "avg", "min", "max", "prod" ("avg" needs floats).
        collective: the all-reduce algorithm, a name in :data:`COLLECTIVES`;
            "auto" picks by the cost model (:func:`explain` says what and why).
        validate: check arguments for agreement across ranks first (a header
            exchange, through shared memory where all ranks share a node).
            None uses the default (on unless ``MPIDL_VALIDATE=0``).
        layout: ranks per node, overriding detection, for the topology-aware
            algorithms and "auto": one number or node sizes ("3,1").
        grid: (X, Y) for "torus2d", X * Y == number of ranks; default from
            the layout (ranks per node x nodes).
        algorithm: the old name of ``collective`` (deprecated: a
            ``DeprecationWarning``; removed in the next release).

    Returns:
        ``buf`` itself.

    Raises:
        ArgumentError: invalid or disagreeing arguments; with validation on,
            raised on every rank before any data moved (``buf`` untouched).
    """
    global _last
    last = _last
    if last is not None and layout is None and grid is None and algorithm is None:
        ref, last_comm, last_op, last_collective, last_validate, dtype, shape, call = last
        if (
            buf is ref()
            and comm is last_comm
            and op is last_op
            and collective is last_collective
            and validate is last_validate
            and buf.dtype is dtype
            and buf.shape == shape
            and buf.flags.carray
            and call.validate is validation.enabled(validate)
            and not call.ctx.freed
        ):
            p2p.operation(call.operation)
            call(buf if len(shape) == 1 else buf.reshape(-1))
            return buf
    if algorithm is not None:
        collective = renamed_keyword("allreduce", "algorithm", "collective", algorithm, collective, DEFAULT_COLLECTIVE)
    call, x = _resolve(buf, _WORLD if comm is None else comm, op, collective, validate, layout, grid)
    if type(buf) is np.ndarray and layout is None and grid is None and algorithm is None:
        _last = (weakref.ref(buf), comm, op, collective, validate, buf.dtype, buf.shape, call)
    p2p.operation(call.operation)
    call(x)
    return buf


class PersistentAllreduce:
    """An all-reduce of one buffer with fixed arguments, resolved once
    (:func:`allreduce_init`): calling it reduces the buffer in place and returns
    it, as ``allreduce(buf, comm, op, collective, ...)`` would, without the
    entry point's look-ups on every call (the buffer's layout, the call's
    arguments), as MPI-4's persistent collectives (``MPI_Allreduce_init``) fix
    theirs. What the arguments decide is the same: the algorithm (for "auto",
    chosen at the first call of that size, as for :func:`allreduce`), and the
    argument check, which with validation on still runs on every call (in the
    shared segment on one node, where it costs no extra synchronisation), so a
    rank calling another persistent all-reduce raises instead of hanging.

    The buffer must keep its memory while the handle is used (no resizing or
    reallocation of the tensor; writing its values is the point).
    """

    __slots__ = ("_buf", "_call", "_x")

    def __init__(self, buf: Any, call: _Call, x: Any) -> None:
        self._buf, self._call, self._x = buf, call, x

    def __call__(self) -> Any:
        """Reduce the buffer in place across the communicator (collective) and return it."""
        call = self._call
        p2p.operation(call.operation)
        call(self._x)
        return self._buf


def allreduce_init(
    buf: Any,
    comm: MPI.Comm | None = None,
    op: str = "sum",
    collective: str = DEFAULT_COLLECTIVE,
    *,
    validate: bool | None = None,
    layout: RanksPerNode = None,
    grid: tuple[int, int] | None = None,
) -> PersistentAllreduce:
    """A :class:`PersistentAllreduce` of ``buf``: calling it does what
    ``allreduce(buf, comm, op, collective, validate=..., layout=..., grid=...)``
    does, for a small vector in less time (docs/performance.rst).

    Arguments as for :func:`allreduce`. With validation on, collective over
    ``comm``, as ``MPI_Allreduce_init``: every rank makes the handle with the
    same arguments, which are checked across ranks here (and again on every
    call); without it, local. ``buf`` is not touched.

    Raises:
        ArgumentError: invalid or (with validation on) disagreeing arguments, on
            every rank together.
    """
    call, x = _resolve(buf, _WORLD if comm is None else comm, op, collective, validate, layout, grid)
    if call.validate:
        validation.check(call.ctx, "allreduce", None, call.signature, _field_names, fields=_FIELDS)
    return PersistentAllreduce(buf, call, x)


def _resolve(
    buf: Any,
    user: MPI.Comm,
    op: str,
    collective: str,
    validate: bool | None,
    layout: RanksPerNode,
    grid: tuple[int, int] | None,
) -> tuple[_Call, Any]:
    """The resolved call of these arguments (kept per communicator, :data:`_CALLS`) and
    ``buf``'s flat view. A bad argument is raised as an ArgumentError, with validation
    on on every rank of ``user`` together (collective then)."""
    ctx = context(user)
    check = validation.enabled(validate)
    try:
        if type(buf) is np.ndarray:
            x, dtype = host_view(buf)
        else:
            x, dtype, _ = as_flat(buf)
        key: Hashable = (collective, op, dtype, x.nbytes, type(x), check, layout, grid)
        try:
            call = ctx.calls.get(key)
        except TypeError:  # an unhashable layout or grid (a list): key by its text
            key = repr(key)
            call = ctx.calls.get(key)
        if call is None:
            if len(ctx.calls) >= _CALLS:
                ctx.calls.clear()
            call = ctx.calls[key] = _Call(ctx, user, collective, op, FlatBuffer(x, dtype, buf), layout, grid, check)
    except ArgumentError as problem:
        p2p.operation(f"allreduce({collective!r})")
        if check:
            validation.check(ctx, "allreduce", problem, (), _field_names, fields=_FIELDS)
        raise
    return call, x


def broadcast(buf: Any, comm: MPI.Comm | None = None, *, root: int = 0, validate: bool | None = None) -> Any:
    """Copy rank ``root``'s ``buf`` into ``buf`` on every rank of ``comm``, in place, and return it.

    A binomial tree (:func:`collectives.kernels.reduce_broadcast.broadcast`):
    ceil(lg p) (alpha + n beta). Buffers and validation as for
    :func:`allreduce`: the same length, dtype and ``root`` on every rank, else
    an ArgumentError on every rank before any data moved (a ``root`` outside
    ``comm`` too).
    """
    ctx = context(_WORLD if comm is None else comm)
    p2p.operation("broadcast")
    flat, problem = None, None
    try:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < ctx.size:
            raise ArgumentError(f"broadcast: root {root!r} is not a rank of the communicator's {ctx.size}")
        flat = as_flat(buf)
    except ArgumentError as exc:
        flat, problem = None, exc
    if validation.enabled(validate):
        signature = (0,) * 5 if flat is None else (flat.size, dtype_code(flat), int(root), _BROADCAST, 0)
        validation.check(ctx, "broadcast", problem, signature, _broadcast_field_names, fields=_BROADCAST_FIELDS)
    if flat is None:  # unchecked (a check raised already)
        raise problem or ArgumentError("broadcast: no buffer")
    if type(flat.data) is not np.ndarray:
        gpu.ensure(ctx.comm, flat)
    if flat.size:
        reduce_broadcast.broadcast(flat.data, ctx.comm, int(root))
    return buf


_BROADCAST = validation.code("broadcast")  # tells a broadcast from another collective in the check
_BROADCAST_FIELDS = ("length", "dtype", "root", "operation", "options")  # the broadcast's signature, for its errors


def _broadcast_field_names() -> tuple[dict[int, str], ...]:
    """Readable names of the broadcast's signature codes, for error messages."""
    return ({}, DTYPE_CODES, {}, {_BROADCAST: "broadcast"})


def explain(
    nbytes: int,
    comm: MPI.Comm | None = None,
    *,
    layout: RanksPerNode = None,
    grid: tuple[int, int] | None = None,
    device: str = "cpu",
    validate: bool | None = None,
    dtype: str = "float32",
    op: str = "sum",
) -> costmodel.Choice:
    """What ``collective="auto"`` runs for a buffer of ``nbytes`` of ``dtype``, reduced
    with ``op``, on ``comm`` (in host memory, or GPU memory with ``device="cuda"``; with the
    argument check as ``validate`` resolves, see :func:`allreduce`), every
    candidate's time (measured, or the cost model's prediction), least first,
    where the choice comes from (``source``: the model, the calibration, online
    tuning, either of those two cached, or the watch, whose rival took the
    choice's place on the calls so far) and the reason. Collective on the first
    use of a communicator and of a size: it may load the cache and measure the
    candidates at the grid sizes around ``nbytes``."""
    user = _WORLD if comm is None else comm
    ctx = context(user)
    node_layout(user, layout)  # an override is checked locally
    if grid is not None:
        hierarchy.check_grid(grid, ctx.size)
    xp = np if device == "cpu" else importlib.import_module("cupy")
    key = _plan_key("auto", layout, grid)
    plan = ctx.cache.get(key)
    if plan is None:
        plan = ctx.cache[key] = _Auto(Request(user, ctx, layout, grid))
    return plan.explain(nbytes, xp, validation.enabled(validate), native.unsupported(dtype, op) is None)


def cost_params(comm: MPI.Comm | None = None, *, layout: RanksPerNode = None, device: str = "cpu") -> costmodel.Params:
    """The cost-model parameters ``collective="auto"`` uses on ``comm`` for host
    (or, with ``device="cuda"``, GPU) buffers: loaded from ``MPIDL_COSTMODEL``,
    or calibrated on first use (collective) and cached on the communicator."""
    user = _WORLD if comm is None else comm
    xp = np if device == "cpu" else importlib.import_module("cupy")
    return _params(user, node_layout(user, layout), context(user), xp)


def _params(comm: MPI.Comm, lay: Layout, ctx: Context, xp: Any = np) -> costmodel.Params:
    """The parameters for ``xp`` memory on ``comm`` (:func:`~collectives.tuning.calibration.params_for`),
    the entry point's own per-call overhead timed with an empty, unchecked all-reduce."""
    empty = np.zeros(0, np.float32)
    return calibration.params_for(
        comm, lay, ctx.cache, xp, entry=lambda: allreduce(empty, comm, "sum", "ring", validate=False)
    )


def _plan_key(algorithm: str, layout: RanksPerNode, grid: tuple[int, int] | None) -> tuple[str, str, str]:
    """The key of an algorithm's plan for these options in the context's cache."""
    return ("plan", algorithm, repr((layout, grid)))


def _rides_check(ctx: Context, name: str, run: Run, x: np.ndarray) -> bool:
    """Whether ``run`` (algorithm ``name``) can reduce the host vector ``x`` together with
    the check on a communicator whose ranks span nodes (:func:`collectives.validation.check`):
    up to the fused limit, the MPI library's all-reduce, in which the check rides where the
    call was the expected one, and in the check's messages the butterfly where the check
    is one recursive doubling over all ranks, the shared-memory algorithm on the check's
    own nodes where it goes through them (collective on first use of the communicator's
    segment and nodes: every rank binds at the same call)."""
    if shm.shared(ctx) is not None:
        return False
    if x.nbytes > validation.FUSE_LIMIT:
        return False
    if isinstance(run, Native):
        return True
    split = validation.nodes(ctx)
    if split is None:
        return name == "butterfly"
    return isinstance(run, Shm) and run.node_of == split.node_of


def _key(x: Any, red: Reduction, validate: bool) -> tuple[int, Any, bool, bool]:
    """What ``auto`` chooses by: size, memory, the check, whether MPI can reduce the dtype and op."""
    return x.nbytes, _memory(x), validate, native.unsupported(red.dtype, red.op) is None


def _memory(x: Any) -> Any:
    """The array module of ``x``'s memory: numpy for host arrays, else e.g. cupy."""
    return np if type(x) is np.ndarray else array_module(x)


def _field_names() -> tuple[dict[int, str], ...]:
    """Readable names of the signature codes, for error messages."""
    return ({}, DTYPE_CODES, {validation.code(op): op for op in OPS}, {validation.code(a): a for a in COLLECTIVES})
