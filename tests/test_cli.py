"""The ``mpidl`` command under its own mpiexec."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from mpi4py import MPI
from mpitest import clean_env, mpiexec, on_rank0_quietly

import collectives
from mpidl import __version__, cli, info

pytestmark = pytest.mark.mpi


def test_info_reports_ranks_and_layout() -> None:
    proc = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", "info"])
    assert proc.returncode == 0, proc.stderr
    report = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in proc.stdout.splitlines())
    assert report["ranks"] == "2"
    assert report["thread level"] == "multiple"
    assert report["MPI library"]


def test_info_json_reports_the_optional_packages_and_gpus() -> None:
    """``mpidl info --json``: one JSON object, keyed as the text report; torch's version where
    torch is installed (null elsewhere), the GPUs and what the MPI library says of GPU memory."""
    proc = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", "info", "--json"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert list(report) == list(info.LABELS)
    assert report["mpidl"] == __version__ and report["ranks"] == 2 and report["ranks_per_node"] == [2]
    if importlib.util.find_spec("torch"):
        import torch

        assert report["torch"] == torch.__version__ and report["cuda"] == torch.version.cuda
        assert report["gpus_per_node"] == [torch.cuda.device_count()]
    else:
        assert report["torch"] is None
    assert report["mpi_gpu_aware"] in (True, False, None)
    assert report["gpu_transport"].split()[0] in ("none", "staged", "direct")


def test_version() -> None:
    """``mpidl --version``, printed once however many ranks run it."""
    proc = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", "--version"])
    assert proc.returncode == 0 and proc.stdout == f"mpidl {__version__}\n", proc.stdout


def test_switches_take_no_and_the_old_on_off_for_now(capsys: pytest.CaptureFixture[str]) -> None:
    """``--overlap``/``--no-overlap`` style switches; mpidl 0.1's ``--overlap on|off`` (and
    ``=on|off``) means the same, with a deprecation message from rank 0."""
    parser = cli.build_parser()
    new = parser.parse_args(["train", "--overlap", "--no-error-feedback", "--epochs", "3"])
    old = parser.parse_args(["train", "--overlap", "on", "--error-feedback=off", "--epochs", "3"])
    assert vars(new) == vars(old) and (new.overlap, new.error_feedback, new.local_momentum) == (True, False, None)
    err = capsys.readouterr().err
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "mpidl train: warning: '--overlap on' is deprecated and goes in the next release; use --overlap" in err
        assert "'--error-feedback off' is deprecated and goes in the next release; use --no-error-feedback" in err
    else:
        assert err == ""
    assert parser.parse_args(["train", "--no-local-momentum"]).local_momentum is False
    assert parser.parse_args(["train"]).algorithm == "allreduce"


def test_a_command_imports_only_its_own_module() -> None:
    """``mpidl train`` (every rank of a job runs it) imports ``mpidl.train`` alone of the
    subcommands' modules; the parser of every command, as without a command, has them all."""
    modules = [m for m, _, _ in [*cli.COMMANDS.values(), *cli.DATA_COMMANDS.values()]]
    code = "import sys; from mpidl import cli; cli.build_parser(sys.argv[1])"
    code += f"; print(*[m for m in {modules!r} if m in sys.modules])"

    def imported(command: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, env=clean_env())
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert on_rank0_quietly(imported, "train") == ["mpidl.train"]
    assert on_rank0_quietly(imported, "data") == ["mpidl.fetch"]
    assert cli.build_parser().parse_args(["data", "fetch"]).run.__module__ == "mpidl.fetch"


def test_the_wheel_carries_the_type_hints(tmp_path_factory: pytest.TempPathFactory) -> None:
    """PEP 561: each package's ``py.typed`` is in the wheel (built from a copy of the sources)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")

    def build() -> list[str]:
        root = Path(__file__).resolve().parent.parent
        for name in ("setup.py", "README.rst"):
            shutil.copy(root / name, src)
        for package in ("mpidl", "collectives", "algorithms"):
            shutil.copytree(root / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), "."]
        subprocess.run(cmd, cwd=src, check=True, capture_output=True, timeout=240)
        (wheel,) = out.glob("mpidl-*.whl")
        return zipfile.ZipFile(wheel).namelist()

    names = on_rank0_quietly(build)
    assert {"mpidl/py.typed", "collectives/py.typed", "algorithms/py.typed"} <= set(names)


@pytest.mark.job
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
