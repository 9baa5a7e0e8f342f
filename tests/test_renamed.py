"""Names that say one thing: ``collective`` is the all-reduce algorithm, ``algorithm`` the
training algorithm. The old names of the all-reduce algorithm (the keyword ``algorithm=``,
``collectives.ALGORITHMS``, ``mpidl.ALGORITHMS``, ...) keep working for one release, with a
``DeprecationWarning`` that names the new one."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size

import algorithms
import collectives
import mpidl
from algorithms import SGD


def test_the_old_registry_names_warn_and_are_the_new_ones() -> None:
    with pytest.deprecated_call(match="use collectives.COLLECTIVES"):
        assert collectives.ALGORITHMS is collectives.COLLECTIVES
    with pytest.deprecated_call(match="use collectives.DEFAULT_COLLECTIVE"):
        assert collectives.DEFAULT_ALGORITHM == collectives.DEFAULT_COLLECTIVE == "auto"
    with pytest.deprecated_call(match="use mpidl.COLLECTIVES"):
        assert mpidl.ALGORITHMS is collectives.COLLECTIVES
    with pytest.deprecated_call():
        from collectives import ALGORITHMS  # noqa: F401  # the import statement warns too
    with pytest.raises(AttributeError, match="no attribute 'NOPE'"):
        collectives.NOPE  # noqa: B018


def test_the_new_names_do_not_warn() -> None:
    comm = MPI.COMM_SELF
    x = np.ones(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        collectives.allreduce(x, comm, "sum", "ring")
        collectives.allreduce(x, comm, collective="ring")
        assert mpidl.COLLECTIVES is collectives.COLLECTIVES
        with algorithms.AllReduceSGD(x, SGD(x, lr=0.1), comm, collective="ring") as algo:
            assert algo.collective == "ring" and algo.bucket_collectives == ("ring",)


@pytest.mark.mpi
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allreduce_takes_the_old_keyword_with_a_warning(size: int) -> None:
    comm = comm_of_size(size)
    x = np.full(5, comm.Get_rank() + 1.0)
    with pytest.deprecated_call(match=r"allreduce: the keyword algorithm= is deprecated .* use collective="):
        collectives.allreduce(x, comm, algorithm="ring")
    n = comm.Get_size()
    assert all_ok(comm, bool(np.all(x == n * (n + 1) / 2)))


def test_both_keywords_are_refused() -> None:
    with pytest.raises(TypeError, match="got both algorithm= and collective="):
        collectives.allreduce(np.ones(2), MPI.COMM_SELF, collective="ring", algorithm="butterfly")


def test_the_compressors_take_the_old_keyword_with_a_warning() -> None:
    for spec in ("none", "sign"):  # the identity overrides allreduce
        g = np.arange(6.0)
        with pytest.deprecated_call(match="Compressor.allreduce: the keyword algorithm="):
            collectives.compressor(spec).allreduce(g, MPI.COMM_SELF, algorithm="ring")
    with pytest.deprecated_call(match="Compressor.check: the keyword algorithm="):
        collectives.compressor("fp16").check(np.ones(3), MPI.COMM_SELF, algorithm="ring")


@pytest.mark.mpi
def test_preduce_takes_the_old_keyword_with_a_warning() -> None:
    comm = comm_of_size(2)
    x = np.full(3, float(comm.Get_rank()))
    with pytest.deprecated_call(match="PReduce: the keyword algorithm="):
        preduce = collectives.PReduce(x, comm, policy="static", algorithm="butterfly")
    with preduce:
        preduce.average()
    n = comm.Get_size()
    assert all_ok(comm, bool(np.all(x == (n - 1) / 2)))


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["allreduce", "lsgd", "prague"])
def test_the_training_algorithms_take_the_old_keyword_with_a_warning(name: str) -> None:
    comm = comm_of_size(2)
    x = np.zeros(3)
    kernel = "butterfly" if name == "prague" else "ring"
    with pytest.deprecated_call(match=r"(AllReduceSGD|LSGD|Prague): the keyword algorithm="):
        algo = algorithms.create(name, x, SGD(x, lr=0.1), comm, algorithm=kernel)
    with algo:
        if name == "prague":
            assert algo.preduce is not None and algo.options["collective"] == kernel
        else:
            assert algo.collective == kernel
            with pytest.deprecated_call(match="the attribute algorithm .* use collective"):
                assert algo.algorithm == kernel


def test_bucket_algorithms_is_the_old_name_of_bucket_collectives() -> None:
    x = np.zeros(3)
    with (
        algorithms.AllReduceSGD(x, SGD(x, lr=0.1), MPI.COMM_SELF, collective="ring") as algo,
        pytest.deprecated_call(match="use bucket_collectives"),
    ):
        assert algo.bucket_algorithms == algo.bucket_collectives == ("ring",)
