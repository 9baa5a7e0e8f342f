"""The ``mpidl`` command under its own mpiexec."""

from __future__ import annotations

import json
import re

import pytest
from mpitest import mpiexec, on_rank0_quietly

import collectives

pytestmark = pytest.mark.mpi


def test_info_reports_ranks_and_layout() -> None:
    proc = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", "info"])
    assert proc.returncode == 0, proc.stderr
    report = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in proc.stdout.splitlines())
    assert report["ranks"] == "2"
    assert report["thread level"] == "multiple"
    assert report["MPI library"]


def test_info_sees_emulated_nodes() -> None:
    proc = on_rank0_quietly(mpiexec, 4, ["-m", "mpidl", "info"], hosts="a:2,b:2")
    assert proc.returncode == 0, proc.stderr
    assert "nodes           2" in proc.stdout and "ranks per node  2 2" in proc.stdout


def test_bench_writes_every_candidate(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = on_rank0_quietly(
        mpiexec,
        2,
        ["-m", "mpidl", "bench", "--sizes", "4K,8K", "--repeat", "2", "--batch-time", "0.001", "--json", str(out)],
    )
    assert proc.returncode == 0, proc.stderr
    data = on_rank0_quietly(lambda: json.loads(out.read_text()))
    names = {r["algorithm"] for r in data["results"]}
    assert names == {"native", "native_inplace", *collectives.COLLECTIVES}
    assert all(r["time"] > 0 and r["vs_native"] > 0 for r in data["results"])
    assert {r["size"] for r in data["results"]} == {4096, 8192}
    assert all(r["chosen"] in collectives.COLLECTIVES for r in data["results"] if r["algorithm"] == "auto")
    assert "4 KiB: pairs the model orders wrongly" in proc.stdout and "8 KiB: model order" in proc.stdout


def test_bench_rejects_unknown_algorithm() -> None:
    proc = on_rank0_quietly(mpiexec, 1, ["-m", "mpidl", "bench", "--collectives", "nope", "--sizes", "4K"])
    assert proc.returncode == 2 and "unknown collective" in proc.stderr


def test_bench_takes_the_old_algorithms_flag_with_a_warning() -> None:
    args = ["-m", "mpidl", "bench", "--algorithms", "ring", "--sizes", "4K", "--repeat", "1", "--batch-time", "0.001"]
    proc = on_rank0_quietly(mpiexec, 1, args)
    assert proc.returncode == 0 and "--algorithms is deprecated" in proc.stderr, proc.stderr
    assert " ring " in proc.stdout and " butterfly " not in proc.stdout, proc.stdout
