"""torch.distributed started from the MPI job: the peers (DDP over gloo) without torchrun.

PyTorch's process groups need a rendezvous: every process must know the
world size, its rank and the address of a store (``MASTER_ADDR`` and
``MASTER_PORT`` under torchrun). An MPI job already knows the first two, and
MPI can hand out the third: rank 0 opens a TCP store on a free port of the
address its peers reach it at, broadcasts (address, port) over the
communicator, and every rank joins with ``init_process_group(backend,
store=..., rank, world_size)``. Ranks of torch.distributed are those of the
communicator, so data shards, models and metrics line up with mpidl's.

Rank 0's address: ``MPIDL_TORCH_ADDR`` if set; otherwise the address of the
interface rank 0 would use to reach the first rank on another host, found by
connecting a UDP socket (nothing is sent), where a rank runs on another
host; ``127.0.0.1`` when all ranks share rank 0's host. gloo picks its own
interface from the hostname; ``GLOO_SOCKET_IFNAME`` overrides it as usual.

A rank that cannot set up its part (an ``MPIDL_TORCH_ADDR`` that is no
address of rank 0's host, a store that cannot be opened or reached) is a
``RuntimeError`` on every rank, naming the rank and the problem, not a rank
left waiting for the others.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from mpi4py import MPI

#: How long the ranks wait for each other to join (seconds).
TIMEOUT_S = 120.0
#: Environment variable naming rank 0's address (module docstring).
ADDR_ENV = "MPIDL_TORCH_ADDR"


def _address(hosts: list[str]) -> str:
    """The address at which the other ranks reach rank 0, on host ``hosts[0]`` (module
    docstring; every rank's host in ``hosts``); local, on rank 0.

    Raises:
        OSError: ``MPIDL_TORCH_ADDR`` is no address of this host, or no route to another
            host was found (the message says which).
    """
    explicit = os.environ.get(ADDR_ENV)
    try:
        if explicit:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((explicit, 0))  # the store listens at it: an address of this host
            return explicit
        remote = next((h for h in hosts if h != hosts[0]), None)
        if remote is None:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(remote), 9))  # UDP connect: routes, sends nothing
            return str(s.getsockname()[0])
    except OSError as exc:
        what = f"{ADDR_ENV}={explicit} is no address of" if explicit else f"no route to {remote} from"
        raise OSError(f"{what} rank 0's host {hosts[0]} ({exc})") from None


def _agree(comm: MPI.Comm, problem: str | None) -> None:
    """Raise RuntimeError on every rank of ``comm`` if any rank has a ``problem`` (collective)."""
    failed = [(rank, p) for rank, p in enumerate(comm.allgather(problem)) if p is not None]
    if failed:
        raise RuntimeError("torch.distributed set-up failed: " + "; ".join(f"rank {r}: {p}" for r, p in failed))


def init_process_group(comm: MPI.Comm | None = None, backend: str = "gloo") -> Any:
    """Join every rank of ``comm`` to torch.distributed's default process group (collective).

    Idempotent for the same world: if torch.distributed is already
    initialised with ``comm``'s size and rank, nothing happens. Returns the
    default process group.

    Raises:
        RuntimeError: torch.distributed is initialised with another world; or, on
            every rank, a rank could not open or reach the store (naming the rank,
            the address and the problem).
    """
    import torch.distributed as dist

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, the communicator has rank {rank} of {size}"
            )
        return dist.group.WORLD
    hosts = comm.allgather(MPI.Get_processor_name())
    store, addr, port, problem = None, "", 0, None
    if rank == 0:
        try:
            addr = _address(hosts)
            store = dist.TCPStore(
                addr, 0, world_size=size, is_master=True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False
            )
            port = store.port
        except OSError as exc:
            problem = str(exc)
        except RuntimeError as exc:  # torch's DistNetworkError, for one
            problem = f"cannot open the store at {addr}: {exc}"
    _agree(comm, problem)
    addr, port = comm.bcast((addr, port), root=0)
    if rank != 0:
        try:
            store = dist.TCPStore(addr, port, world_size=size, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        except RuntimeError as exc:
            problem = f"cannot reach rank 0's store at {addr}:{port}: {exc}"
    _agree(comm, problem)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=TIMEOUT_S))
    return dist.group.WORLD


def destroy_process_group() -> None:
    """Leave torch.distributed's default process group, if joined."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
