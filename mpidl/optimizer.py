"""Horovod's ``DistributedOptimizer``: an optimizer whose step averages the gradients first.

``mpidl.DistributedOptimizer(optimizer, named_parameters=...)`` builds an
:class:`algorithms.AllReduceSGD` over the optimizer's parameters (no model
needed) and returns the optimizer itself, its class extended on the fly, as
Horovod's returns an instance of a subclass made on the fly: it is still a
``torch.optim.Optimizer`` of its kind (learning-rate schedulers, ``GradScaler``,
``state_dict()`` work as before), and its ``step()`` now all-reduces
(averages) the gradients over the workers first, bucket by bucket, during
backward where a core is free for it (AllReduce-SGD's overlap). It gains:

* ``synchronize()``: the step's communication now, leaving the average in
  ``p.grad`` (to clip or unscale), after which ``step()`` applies the update
  alone, as Horovod's ``optimizer.synchronize()``; ``skip_synchronize()`` is
  accepted around that ``step()`` (Horovod needs it there; here ``step()``
  knows by itself that the gradients are averaged already);
* ``join()``: the context for workers with uneven numbers of batches
  (:mod:`algorithms.join`; Horovod's ``hvd.join()``);
* ``algorithm``: the :class:`~algorithms.AllReduceSGD`, for the rest of its API
  (``no_sync()`` for Horovod's ``backward_passes_per_step``, ``bytes_sent``).

Only parameters travel: the model's buffers (BatchNorm statistics) stay each
worker's own, as with Horovod; the construction broadcasts rank 0's parameters
(``broadcast_init=False`` keeps each worker's, as Horovod does until
``broadcast_parameters``). Collective: every worker builds it at the same point.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from mpi4py import MPI

from algorithms import AllReduceSGD
from algorithms.join import Join
from collectives import ArgumentError


class _Distributed:
    """What :func:`DistributedOptimizer` adds to the optimizer's class."""

    algorithm: AllReduceSGD

    def synchronize(self) -> None:
        """Average the step's gradients over the workers now (collective), leaving the
        average in ``p.grad``; the next ``step()`` applies the update alone."""
        self.algorithm.synchronize()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's context around a ``step()`` after :meth:`synchronize`; here ``step()``
        knows that the gradients are averaged already, so it changes nothing."""
        yield

    def join(self) -> Join:
        """The context for uneven inputs (:meth:`algorithms.AllReduceSGD.join`)."""
        return self.algorithm.join()


def DistributedOptimizer(  # Horovod's name for what Horovod makes a function too
    optimizer: Any,
    named_parameters: Iterable[tuple[str, Any]] | None = None,
    *,
    comm: MPI.Comm | None = None,
    **options: Any,
) -> Any:
    """``optimizer`` (a torch optimizer), now averaging the gradients over the workers of
    ``comm`` (default ``MPI.COMM_WORLD``) at every step (module docstring).

    Args:
        optimizer: the worker's torch optimizer; its parameters are the model's
            (``torch.nn.Parameter`` objects, one dtype and device).
        named_parameters: ``model.named_parameters()``, as Horovod takes it: the
            order of the parameters in the flat buffers (the optimizer's own order
            without it); every parameter of the optimizer must be named once.
        comm: the workers' communicator.
        options: :class:`~algorithms.AllReduceSGD`'s keyword arguments
            (``collective``, ``overlap``, ``bucket_mb``, ``compression``,
            ``broadcast_init``, ...).

    Raises:
        ArgumentError: a parameter of the optimizer not named, a name given twice, or
            what AllReduce-SGD's construction raises (on every rank).
    """
    import torch

    if isinstance(optimizer, _Distributed):
        raise ArgumentError("DistributedOptimizer: the optimizer is distributed already")
    held = [p for group in optimizer.param_groups for p in group["params"]]
    order = held
    if named_parameters is not None:
        named = list(named_parameters)
        names = [name for name, _ in named]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ArgumentError(f"DistributedOptimizer: named_parameters names {', '.join(twice)} more than once")
        ids = {id(p) for p in held}
        order = [p for _, p in named if id(p) in ids]
        if len(order) != len(held):
            raise ArgumentError(
                f"DistributedOptimizer: {len(held) - len(order)} of the optimizer's {len(held)} parameters "
                "are not in named_parameters (pass model.named_parameters() of the model it optimizes)"
            )
    algorithm = AllReduceSGD(torch.nn.ParameterList(order), optimizer, comm, **options)
    optimizer.__class__ = _extended(type(optimizer))
    optimizer.algorithm = algorithm
    return optimizer


_EXTENDED: dict[type, type] = {}  # optimizer classes and their Distributed<class>


def _extended(kind: type) -> type:
    """``kind`` with :class:`_Distributed`'s methods, named Distributed<kind> (made once)."""
    if kind not in _EXTENDED:
        _EXTENDED[kind] = type(f"Distributed{kind.__name__}", (_Distributed, kind), {"__module__": kind.__module__})
    return _EXTENDED[kind]
