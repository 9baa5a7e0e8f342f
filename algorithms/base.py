"""What every training algorithm shares: flat model, local optimizer, step, counters.

A training algorithm wraps a local optimizer. Each worker (MPI rank) computes
the gradient of its own loss, then calls :meth:`Algorithm.step`, which
communicates — gradients, models, or both — and applies the local optimizer.

Torch::

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    algo = DPSGD(model, opt, topology="ring")
    for x, y in batches:
        algo.zero_grad()
        loss_fn(model(x), y).backward()
        algo.step()

numpy (``x`` the parameter array, ``grad_fn`` the local gradient)::

    opt = SGD(x, lr=0.1, momentum=0.9)           # algorithms.optim.SGD
    algo = DPSGD(x, opt, topology="ring")
    for _ in range(steps):
        algo.step(grad_fn(x))                    # or write into opt.grad, then algo.step()

Construction is collective over ``comm``: the model is flattened
(:mod:`algorithms.flat`), the configuration is checked across ranks (same
algorithm, options, model length and dtype on every rank, else the same
:class:`~collectives.ArgumentError` on every rank; ``validate=False`` skips
the check), rank 0's parameters are broadcast so that every worker starts
from the same model (``broadcast_init=False`` keeps each worker's own), and
then sub-communicators and service threads are set up (so that no thread
serves a model the broadcast has yet to write). Steps then run their
collectives unchecked (``validate=False``): the arguments are the same every
step and were checked once.

Counters, per worker: :attr:`~Algorithm.iterations`;
:attr:`~Algorithm.bytes_sent`, the payload bytes this worker sent during steps
(counted by :mod:`collectives.transport.p2p`, so exact: e.g. 2(n-1)/n x model bytes per
ring all-reduce); :attr:`~Algorithm.comm_wait_s`, the seconds steps spent in
communication or waiting for it.

Step counts: in a synchronous algorithm every step of every worker takes part
in the same collective, so all workers take the same number of steps; GR-SGD
bounds how far a worker runs ahead of its neighbors, and also needs every
worker to take the same number of steps between two :meth:`~Algorithm.settle`
calls. In AD-PSGD and Prague (random or smart groups) no step waits for a
given worker's progress, and a fast worker may take more steps than a slow
one (:attr:`Algorithm.uneven_steps`): a training loop should then count the
steps of all workers together (``mpidl train`` does, :mod:`mpidl.pacing`).
Any algorithm may keep communication in flight between steps;
:meth:`Algorithm.settle` (collective) finishes it, after which every worker's
parameters stay as they are until its next step — the moment to evaluate or
save the models.

Checkpoints: after :meth:`~Algorithm.settle`, a worker's whole state is its
model's (:attr:`Algorithm.state`: parameters and buffers), its optimizer's,
and :meth:`Algorithm.state_dict`: the counters and what the algorithm keeps
between steps (LSGD the gradient sum its next step applies, AD-PSGD its
random generator, GR-SGD its exchange counts, Prague the static schedule's
position and the group generator's state). A fresh instance of the same
configuration continues from it after :meth:`~Algorithm.load_state_dict`.

In a user's own loop (``docs/training.rst``, "Your own PyTorch script"):
:meth:`Algorithm.no_sync` for backward passes that only accumulate
gradients; :meth:`Algorithm.synchronize` (synchronous algorithms) to run the
step's communication first, so that the gradients are those the update
applies when clipping or unscaling them, after which ``step()`` or the
optimizer's own ``step()`` (e.g. a ``GradScaler``'s) applies the update;
the torch optimizer's own ``step()`` alone, as with DDP, runs
:meth:`~Algorithm.synchronize` first where the step's gradients were not
communicated yet (a step pre-hook; the asynchronous algorithms and compressed
D-PSGD, which communicate during or after the update, raise: their step is
``step()``); a ``GradScaler`` needs ``synchronize()`` before it checks the
gradients, as with Horovod, else it raises;
:meth:`Algorithm.average_buffers` (or ``average_buffers=True`` for every
step) for BatchNorm statistics; :func:`algorithms.broadcast.broadcast_optimizer_state`
for an optimizer state restored on rank 0.

Writing a new algorithm: subclass :class:`Algorithm`, set ``name``, and
implement :meth:`~Algorithm._step` (a synchronous one: also
:meth:`~Algorithm._synchronize`, the part before the optimizer's update, and
set ``synchronous``); override :meth:`~Algorithm._configure`
(local checks, returns the options every rank must agree on),
:meth:`~Algorithm._start` (collective set-up), :meth:`~Algorithm.settle` and
:meth:`~Algorithm.close` (threads, communicators), and
:meth:`~Algorithm.state_dict` and :meth:`~Algorithm._load_state` (state
kept between steps) as needed; register the
class in :data:`algorithms.ALGORITHMS`. Service threads that overlap
communication with computation are :class:`collectives.transport.background.Background`.
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, ClassVar

import numpy as np
from mpi4py import MPI

import collectives
from collectives import ArgumentError, as_flat, validation
from collectives.errors import renamed
from collectives.topology.layout import RanksPerNode
from collectives.transport import gpu
from collectives.transport.buffers import DTYPE_CODES, dtype_code
from collectives.transport.context import context
from collectives.transport.p2p import bytes_sent

from . import events
from .flat import FlatParams, flatten


class StateError(ValueError):
    """A state that does not fit on some workers, raised on every worker by
    :meth:`Algorithm.load_state_dict`.

    Attributes:
        problems: what did not fit, by the rank of each worker whose state failed.
    """

    def __init__(self, problems: dict[int, str]) -> None:
        self.problems = problems
        super().__init__(
            "load_state_dict: the state does not fit on " + "; ".join(f"rank {r}: {p}" for r, p in problems.items())
        )


class Algorithm(ABC):
    """A data-parallel training algorithm on one worker.

    Args:
        model: a ``torch.nn.Module`` or a numpy parameter array.
        optimizer: the local optimizer over the model's parameters (a torch
            optimizer, or :class:`algorithms.optim.SGD` for numpy).
        comm: the workers' communicator (default ``MPI.COMM_WORLD``).
        broadcast_init: start every worker from rank 0's parameters (and buffers).
        average_buffers: average the model's float buffers over the workers
            every step (:meth:`average_buffers`); synchronous algorithms only.
        validate: check the configuration across ranks at construction
            (None: the collectives' default, on unless ``MPIDL_VALIDATE=0``).

    Attributes:
        comm, rank, size: the communicator, this worker's rank, the number of workers.
        optimizer: the local optimizer.
        broadcast_init: whether every worker started from rank 0's parameters.
        flat: the flat parameters and gradients (:class:`~algorithms.flat.FlatParams`).
        iterations: steps taken.
        bytes_sent: payload bytes this worker sent during steps.
        comm_wait_s: seconds steps spent communicating or waiting for communication.
        closed: whether :meth:`close` was called.
        buffer_averaging: whether every step averages the float buffers.
    """

    #: The algorithm's name in :data:`algorithms.ALGORITHMS`.
    name: ClassVar[str]
    #: Whether workers may take different numbers of steps between settle() calls (module docstring).
    uneven_steps: bool = False
    #: Whether every worker takes part in every step's communication, in step with the others
    #: (AllReduce-SGD, D-PSGD, LSGD); then a collective may join each step (``average_buffers``).
    synchronous: ClassVar[bool] = False
    #: The all-reduce algorithm (collective) and layout of :meth:`average_buffers` (AllReduce-SGD
    #: and LSGD set their own; "auto" calibrates the cost model on first use, once per communicator).
    collective: str = collectives.DEFAULT_COLLECTIVE
    layout: RanksPerNode = None

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        broadcast_init: bool = True,
        average_buffers: bool = False,
        validate: bool | None = None,
    ) -> None:
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.optimizer = optimizer
        self.broadcast_init = bool(broadcast_init)
        self.iterations = 0
        self.bytes_sent = 0
        self.comm_wait_s = 0.0
        self.closed = False
        self.buffer_averaging = bool(average_buffers)
        self._synchronized = False  # synchronize() ran since the last gradient; step() applies the update alone
        self._stepping = False  # inside step(): the optimizer's step is the algorithm's own
        self._step_hooks: list[Any] = []  # on the torch optimizer and parameters, removed at close()
        problem = None
        try:
            self.flat: FlatParams = flatten(model, optimizer)
            if self.buffer_averaging and not self.synchronous:
                raise ArgumentError(
                    f"average_buffers=True adds an all-reduce to every step, which needs workers that step "
                    f"together; {self.name}'s do not: call average_buffers() after settle() instead"
                )
            options = (self._configure(), self.buffer_averaging)
        except (ValueError, TypeError) as exc:  # ArgumentError, TopologyError, bad option values
            problem = exc if isinstance(exc, ArgumentError) else ArgumentError(f"{type(exc).__name__}: {exc}")
        if validation.enabled(validate):
            signature = (
                (0,) * 5
                if problem
                else (
                    self.flat.size,
                    dtype_code(as_flat(self.flat.params)),
                    0,
                    validation.code(self.name),
                    validation.code(repr(options)),
                )
            )
            validation.check(context(self.comm), "training algorithm set-up", problem, signature, _field_names)
        elif problem:
            raise problem
        gpu.ensure(context(self.comm).comm, as_flat(self.flat.params))  # a device model: pick the transport now
        if broadcast_init:  # before _start(): no service thread may touch the parameters meanwhile
            collectives.broadcast(self.flat.state, self.comm, validate=False)
        self._start()
        if hasattr(optimizer, "register_step_pre_hook"):  # a torch optimizer the caller may step
            self._step_hooks += [
                optimizer.register_step_pre_hook(self._optimizer_steps),
                optimizer.register_step_post_hook(self._optimizer_stepped),
            ]
            self._step_hooks += [
                p.register_post_accumulate_grad_hook(self._gradient_accumulated)
                for p, _ in getattr(self.flat, "views", ())
                if p.requires_grad
            ]

    @property
    def algorithm(self) -> str:
        """The old name of :attr:`collective` (deprecated: a ``DeprecationWarning``)."""
        renamed(type(self).__name__, "the attribute algorithm (the all-reduce algorithm)", "collective")
        return self.collective

    @property
    def params(self) -> Any:
        """The flat parameter buffer (a 1-D torch tensor or numpy view aliasing the model)."""
        return self.flat.params

    @property
    def state(self) -> Any:
        """The flat state buffer: the parameters followed by the model's float buffers
        (e.g. BatchNorm statistics), or :attr:`params` itself when it has none
        (:mod:`algorithms.flat`)."""
        return self.flat.state

    @property
    def grads(self) -> Any:
        """The flat gradient buffer (same kind and length as :attr:`params`)."""
        return self.flat.grads

    def zero_grad(self) -> None:
        """Set the gradients to zero without breaking their aliasing of :attr:`grads`."""
        self.flat.zero_grad()

    def step(self, grad: Any = None) -> None:
        """Communicate and apply one local optimizer step; collective over :attr:`comm`.

        Call it after the gradient is in place: torch, after
        ``loss.backward()``; numpy, after writing the gradient into the
        optimizer's ``grad`` array, or pass it here as ``grad`` (any array of
        the model's size; it is copied into the flat gradient buffer).
        After :meth:`synchronize` it applies the update alone (local).
        """
        if self.closed:
            raise RuntimeError(f"{self!r} is closed")
        self._stepping = True
        try:
            if self._synchronized:
                if grad is not None:
                    raise ValueError("step(grad) after synchronize(): the step's gradient was communicated already")
                self._synchronized = False
                self._update()
                return
            if grad is not None:
                values = np.asarray(grad).reshape(-1)
                if values.shape != self.flat.grad_data.shape:
                    raise ValueError(f"gradient has {values.size} elements, the model {self.flat.size}")
                np.copyto(self.flat.grad_data, values)
            self._collect_grads()
            self._step()
            if self.buffer_averaging:
                self.average_buffers()
            self.iterations += 1
        finally:
            self._stepping = False

    def synchronize(self) -> None:
        """Run the step's communication now (collective over :attr:`comm`; synchronous
        algorithms): afterwards the gradients hold what the update will apply —
        AllReduce-SGD the average of the workers' gradients, LSGD the average of the
        previous step's (zero on the first step, whose update applies nothing), D-PSGD the
        worker's own, its model already averaged with its neighbors'. Clip or unscale
        them in place, then finish the step with :meth:`step`, which applies the update
        alone, or with the optimizer's own ``step()`` (``GradScaler.step(optimizer)``,
        which skips it when the gradients hold an inf or a NaN: the same on every
        worker where they are averaged). Between the two, change nothing but the
        gradients; the step is counted here. Once per step.

        Raises:
            NotImplementedError: the algorithm communicates during or after its
                update (the asynchronous ones, compressed D-PSGD).
        """
        if self.closed:
            raise RuntimeError(f"{self!r} is closed")
        self._collect_grads()
        self._synchronize()
        if self.buffer_averaging:
            self.average_buffers()
        self.iterations += 1
        self._synchronized = True

    @contextmanager
    def no_sync(self, enabled: bool = True) -> Iterator[None]:
        """Backward passes inside only accumulate their gradients; the step communicates
        after the last one, outside (``enabled=False``: no effect, so that ``with
        algo.no_sync(enabled=not last):`` can wrap every pass of a step). Algorithms
        that communicate gradients during backward (AllReduce-SGD with overlap) hold it
        back; the others communicate in :meth:`step` alone and need nothing from it."""
        yield

    def join(self) -> Any:
        """A context for workers with uneven numbers of batches (AllReduce-SGD's
        :meth:`~algorithms.allreduce_sgd.AllReduceSGD.join`, :mod:`algorithms.join`).

        Raises:
            NotImplementedError: the others have none: D-PSGD, LSGD and GR-SGD
                average models or group sums, in which a worker out of data cannot
                be left out by contributing zeros; AD-PSGD and Prague (random or
                smart groups) let workers take different numbers of steps without
                it (:attr:`uneven_steps`).
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no join(): only AllReduce-SGD averages over the workers still in "
            + (
                "(this algorithm lets workers take different numbers of steps: stop stepping, then settle())"
                if self.uneven_steps
                else "(this algorithm averages models or group sums, which a worker out of data cannot leave)"
            )
        )

    def average_buffers(self) -> None:
        """Average the model's float buffers (BatchNorm's running statistics: the state
        after the parameters, :mod:`algorithms.flat`) over the workers, in place, with
        the bits the same on every worker; collective over :attr:`comm`, an all-reduce
        with :attr:`algorithm`. Algorithms that average gradients keep the buffers local,
        so each worker's follow its own data: call it before evaluating, or ask for it
        every step with ``average_buffers=True``. Asynchronous algorithms: after
        :meth:`settle`. Without buffers it does nothing."""
        if self.closed:
            raise RuntimeError(f"{self!r} is closed")
        if self.flat.has_buffers:
            with self._communicating():
                buffers = self.flat.state[self.flat.size :]
                collectives.allreduce(buffers, self.comm, "avg", self.collective, validate=False, layout=self.layout)

    def settle(self) -> None:
        """Finish the communication that changes parameters in flight (collective):
        afterwards every worker's parameters stay as they are until its next step.
        Steps may follow. The base class has none in flight."""
        if self.closed:
            raise RuntimeError(f"{self!r} is closed")

    def close(self) -> None:
        """Release threads and communicators the algorithm holds (collective); no step
        may follow. Idempotent. Subclasses release theirs, then call this."""
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks.clear()
        self.closed = True

    def state_dict(self) -> dict[str, Any]:
        """What this worker keeps between steps besides its model and its optimizer:
        numpy arrays (host copies) and JSON-able values, keyed by name.

        Call it on every worker after :meth:`settle` (collective: LSGD sends its
        group the gradient sum in flight). The base class holds the counters;
        subclasses add their own state to it.
        """
        return {"iterations": self.iterations, "bytes_sent": self.bytes_sent, "comm_wait_s": self.comm_wait_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, a :meth:`state_dict` of this configuration, before
        the first step; the worker's model (and optimizer) state loaded first.

        Collective: it returns once every worker has loaded its state, so that no
        worker's first step reaches one still loading (an asynchronous algorithm's
        service thread answers the other workers at any time; the group generator's
        state must be in place before the first request).

        Raises:
            StateError: on every worker where some worker's state does not fit (a
                missing key, an array of the wrong length, a value of the wrong
                type), naming those workers and their problems. A worker whose state
                failed may hold part of it: load another state or close the algorithm.
        """
        problem: Exception | None = None
        try:
            self._load_state(state)
        except (KeyError, ValueError, TypeError) as exc:
            problem = exc
        text = None if problem is None else f"lacks {problem}" if isinstance(problem, KeyError) else str(problem)
        problems = {rank: p for rank, p in enumerate(context(self.comm).comm.allgather(text)) if p is not None}
        if problems:
            raise StateError(problems) from problem

    def _load_state(self, state: dict[str, Any]) -> None:
        """Load this worker's part of :meth:`load_state_dict` (local): subclasses load their
        own state after the base class's counters.

        Raises:
            ValueError: an array of the wrong length, or state this worker cannot use.
        """
        self.iterations = int(state["iterations"])
        self.bytes_sent = int(state["bytes_sent"])
        self.comm_wait_s = float(state["comm_wait_s"])

    def __enter__(self) -> Algorithm:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        """Close, unless an exception other than an ArgumentError leaves the block: it
        may be this rank's alone, and the collective close() would wait for the other
        ranks (or fail first) before it is printed (``docs/failures.rst``). mpidl raises
        an ArgumentError on every rank alike, so the ranks close together."""
        if kind is None or issubclass(kind, ArgumentError):
            self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank {self.rank} of {self.size}, {self.flat.size} parameters)"

    # --- for subclasses -------------------------------------------------------

    def _configure(self) -> Hashable:
        """Check and resolve the options, locally (no communication: another rank may
        already have failed). Returns the options every rank must agree on (compared
        by their repr); raises ValueError (e.g. ArgumentError) for bad options."""
        return ()

    def _start(self) -> None:
        """Collective set-up after the ranks agreed (sub-communicators, threads)."""

    def _collect_grads(self) -> None:
        """Make the flat gradient buffer hold the gradients, before :meth:`_step`
        (an algorithm that reads them where they are overrides it)."""
        self.flat.collect_grads()

    @abstractmethod
    def _step(self) -> None:
        """Communicate and apply ``self.optimizer.step()``; gradients are in ``self.flat``."""

    def _synchronize(self) -> None:
        """:meth:`_step` up to the optimizer's update: communicate, and leave in the
        gradients what :meth:`_update` applies (synchronous algorithms override it)."""
        raise NotImplementedError(
            f"{type(self).__name__} communicates during and after its optimizer step, never all before it, "
            "so no moment has final gradients and no update yet; its gradients are the worker's own: "
            "clip or unscale them before step()"
        )

    def _update(self) -> None:
        """The update that follows :meth:`_synchronize` (LSGD's may apply nothing)."""
        self.optimizer.step()

    def _optimizer_steps(self, *_: Any) -> None:
        """The torch optimizer's step pre-hook. A step the caller makes (not :meth:`step`'s
        own) whose gradients were not communicated yet runs :meth:`synchronize` first, as
        DDP and Horovod make a plain ``optimizer.step()`` average the gradients; the
        algorithms that communicate during or after their update refuse it.

        Raises:
            RuntimeError: the algorithm cannot communicate before the update, or a
                GradScaler is stepping the optimizer without ``synchronize()`` first.
        """
        if self._stepping or self._synchronized:
            return
        if _grad_scaler_stepping():
            raise RuntimeError(
                "a GradScaler steps the optimizer, but the gradients were not synchronized: the scaler "
                "checked this worker's own gradients for inf and NaN, and workers that disagree on "
                "skipping the step would leave each other waiting; call algo.synchronize() after "
                "backward(), before scaler.unscale_() and scaler.step()"
            )
        try:
            self.synchronize()
        except NotImplementedError:
            raise RuntimeError(
                f"{type(self).__name__} communicates during or after its optimizer step, so "
                "optimizer.step() alone would train this worker without communicating: finish "
                "each step with algo.step(), which communicates and steps the optimizer"
            ) from None

    def _optimizer_stepped(self, *_: Any) -> None:
        """The torch optimizer's step post-hook: a step after synchronize() is finished."""
        self._synchronized = False

    def _gradient_accumulated(self, _: Any) -> None:
        """A parameter's post-accumulate-grad hook: backward brings a gradient not yet
        communicated (a synchronize() whose update was skipped no longer counts)."""
        self._synchronized = False

    @contextmanager
    def _communicating(self, name: str = "communicate", category: str = events.COMMUNICATION) -> Iterator[None]:
        """Count the time and the bytes this thread spends in the enclosed communication
        (or waiting for it: ``category`` :data:`~algorithms.events.WAIT`); a recorded
        timeline (:mod:`algorithms.events`) gets it as a span ``name`` of this step."""
        t0, b0 = time.perf_counter(), bytes_sent()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.comm_wait_s += t1 - t0
            self.bytes_sent += bytes_sent() - b0
            recorder = events.active
            if recorder is not None:
                recorder.add(name, category, t0, t1, step=self.iterations)


def _grad_scaler_stepping() -> bool:
    """Whether an enabled torch ``GradScaler`` calls the optimizer's step now: its
    ``step()`` is among the callers of the step's hooks (a few frames up)."""
    torch = sys.modules.get("torch")
    frame: FrameType | None = sys._getframe(2)
    for _ in range(6):
        if frame is None or torch is None:
            return False
        caller = frame.f_locals.get("self")
        if isinstance(caller, torch.amp.GradScaler):
            return bool(caller.is_enabled())
        frame = frame.f_back
    return False


def _field_names() -> tuple[dict[int, str], ...]:
    """Readable values of the set-up signature, for error messages (the names of
    every algorithm class defined, registered or not)."""
    classes, names = [Algorithm], {}
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        if "name" in vars(cls):
            names[validation.code(cls.name)] = cls.name
    return ({}, DTYPE_CODES, {}, names)
