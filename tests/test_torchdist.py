"""torch.distributed started from the MPI job (:mod:`mpidl.torchdist`): a set-up that fails
on one rank raises on every rank, naming the problem, instead of leaving the others waiting."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from mpidl import torchdist

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(60)
def test_an_address_not_of_rank_0s_host_raises_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """192.0.2.1 (TEST-NET-1, RFC 5737) is no host's address: rank 0 cannot open the store there."""
    dist = pytest.importorskip("torch.distributed")
    monkeypatch.setenv("MPIDL_TORCH_ADDR", "192.0.2.1")
    with pytest.raises(RuntimeError) as exc:
        torchdist.init_process_group(MPI.COMM_WORLD)
    host = MPI.COMM_WORLD.bcast(MPI.Get_processor_name())
    assert str(exc.value).startswith(
        f"torch.distributed set-up failed: rank 0: MPIDL_TORCH_ADDR=192.0.2.1 is no address of rank 0's host {host} ("
    ), exc.value
    assert not dist.is_initialized()
