"""Broadcasting an optimizer's state: what an algorithm's construction leaves local.

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

from typing import Any

from mpi4py import MPI

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
