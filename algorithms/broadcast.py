"""Broadcasting a model's tensors and an optimizer's state, as Horovod's helpers do.

:func:`broadcast_parameters` gives every worker one worker's tensors, in
place: a ``state_dict()`` or ``named_parameters()`` (Horovod's
``broadcast_parameters``). An algorithm's construction does that for its model
already (``broadcast_init``); the function serves tensors outside it, or a
script ported from Horovod as it stands.

Construction broadcasts rank 0's model, parameters and float buffers
(:class:`~algorithms.base.Algorithm`), so every worker starts from the same
one. The optimizer's state stays each worker's own: SGD's momentum
buffers, Adam's moments and step counts, and each parameter group's
learning rate and other hyper-parameters. It matters when rank 0 alone
loaded a checkpoint, or when the workers' set-ups differ.
:func:`broadcast_optimizer_state` gives every worker the state of one, as
``horovod.torch.broadcast_optimizer_state`` does.

The root's whole ``state_dict()`` is sent, pickled (``comm.bcast``: a binomial
tree of ceil(lg n) messages of its size), and loaded with
``load_state_dict()``. State that optimizers create at their first step is
covered by that: a worker whose optimizer has not stepped gets the root's
buffers, and one that has stepped when the root has not drops its own;
afterwards every worker holds what the root holds, and the next step of
every worker makes the same state from the same gradients.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives
from collectives import ArgumentError


def broadcast_optimizer_state(optimizer: Any, comm: MPI.Comm | None = None, root: int = 0) -> None:
    """Replace every worker's ``optimizer`` state (buffers and parameter groups' settings)
    by that of rank ``root``'s (collective over ``comm``, default ``MPI.COMM_WORLD``).

    ``optimizer`` is a torch optimizer (anything with ``state_dict()`` and
    ``load_state_dict()``) over the same parameters on every worker, in the
    same groups; its state tensors land on the parameters' device and dtype.

    Raises:
        ArgumentError: on every rank, before any state moved, for a ``root``
            that differs between ranks or lies outside ``comm``, or an
            optimizer without a state dict; on every rank, after, if a worker
            could not load the root's state (other parameter groups or sizes),
            naming the worker.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    usable = callable(getattr(optimizer, "state_dict", None)) and callable(getattr(optimizer, "load_state_dict", None))
    calls = comm.allgather((root, usable, type(optimizer).__name__))
    if len({r for r, _, _ in calls}) != 1:
        raise ArgumentError(f"broadcast_optimizer_state: the ranks name different roots: {[r for r, _, _ in calls]}")
    if not (isinstance(root, int) and 0 <= root < comm.Get_size()):
        raise ArgumentError(f"broadcast_optimizer_state: root {root!r} is not a rank of {comm.Get_size()}")
    unusable = [f"rank {r}: {name}" for r, (_, ok, name) in enumerate(calls) if not ok]
    if unusable:
        raise ArgumentError(
            f"broadcast_optimizer_state needs an optimizer with state_dict() and load_state_dict() "
            f"(a torch optimizer); got {', '.join(unusable)}"
        )
    state = comm.bcast(optimizer.state_dict() if comm.Get_rank() == root else None, root=root)
    problem = None
    if comm.Get_rank() != root:
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            problem = f"rank {comm.Get_rank()} could not load rank {root}'s optimizer state: {exc}"
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        raise ArgumentError(f"broadcast_optimizer_state: {problems[0]}")


def broadcast_parameters(
    params: Mapping[str, Any] | Iterable[tuple[str, Any]], comm: MPI.Comm | None = None, root: int = 0
) -> None:
    """Copy rank ``root``'s tensors into every worker's, in place (collective over ``comm``,
    default ``MPI.COMM_WORLD``), as ``horovod.torch.broadcast_parameters`` does.

    ``params``: a mapping from names to tensors, such as ``model.state_dict()``
    (taken in the order of the sorted names), or (name, tensor) pairs, such as
    ``model.named_parameters()`` (in their order); torch tensors or numpy arrays
    of the collectives' dtypes (:data:`collectives.DTYPES`), contiguous. Every
    worker passes the same names, shapes and dtypes. One binomial-tree
    broadcast per tensor (:func:`collectives.broadcast`).

    Raises:
        ArgumentError: on every rank, before any tensor moved, for a ``root`` that
            differs between ranks or lies outside ``comm``, a tensor the collectives
            refuse, or names, shapes or dtypes that differ between ranks (naming
            the first that differs).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    items = sorted(params.items()) if isinstance(params, Mapping) else list(params)
    problem, described = None, []
    for entry in items:
        try:
            name, tensor = entry
            flat = collectives.as_flat(tensor)
        except (ArgumentError, TypeError, ValueError) as exc:
            problem = f"{entry!r:.60}: {exc}"
            break
        memory = "" if type(flat.data) is np.ndarray else " (device)"
        described.append((name, tuple(tensor.shape), flat.dtype + memory))
    calls = comm.allgather((root, problem, described))
    roots = [r for r, _, _ in calls]
    if len(set(roots)) != 1:
        raise ArgumentError(f"broadcast_parameters: the ranks name different roots: {roots}")
    if not (isinstance(root, int) and 0 <= root < comm.Get_size()):
        raise ArgumentError(f"broadcast_parameters: root {root!r} is not a rank of {comm.Get_size()}")
    refused = [f"rank {r}: {p}" for r, (_, p, _) in enumerate(calls) if p is not None]
    if refused:
        raise ArgumentError(f"broadcast_parameters: a tensor is refused on {'; '.join(refused)}")
    reference = calls[root][2]
    for r, (_, _, theirs) in enumerate(calls):
        if theirs != reference:
            i = next((i for i, (a, b) in enumerate(zip(theirs, reference)) if a != b), min(len(theirs), len(reference)))
            here, there = (d[i] if i < len(d) else "no tensor" for d in (theirs, reference))
            raise ArgumentError(
                f"broadcast_parameters: the tensors of rank {r} and rank {root} differ at entry {i} "
                f"(name, shape, dtype): {here} against {there}",
                [r],
            )
    for _, tensor in items:
        collectives.broadcast(tensor, comm, root=root, validate=False)
