"""``examples/``: the PyTorch script trains under its own mpiexec on a small synthetic
Fashion-MNIST, and the README's diff shows exactly the lines it marks as changed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from mpitest import mpiexec, on_rank0_quietly
from test_train_models import synthetic_fashion

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_cnn.py"
MARK = "# mpidl"

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the example needs torch")


@pytest.fixture(scope="module")
def fashion(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("fashion")
    return on_rank0_quietly(synthetic_fashion, folder)


def example(ranks: int, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the example on ``ranks`` ranks from rank 0 (one torch thread each); (rc, stdout, stderr)."""
    done = on_rank0_quietly(
        mpiexec, ranks, [str(EXAMPLE), *args], timeout=240, env={"OMP_NUM_THREADS": "1", **(env or {})}
    )
    return done.returncode, done.stdout, done.stderr


def accuracies(stdout: str) -> list[float]:
    return [float(a) / 100 for a in re.findall(r"test accuracy\s+([\d.]+)%", stdout)]


@pytest.mark.mpi
@needs_torch
def test_the_example_learns_with_amp_clipping_and_accumulation(fashion: str) -> None:
    """AllReduce-SGD, bfloat16 autocast with a GradScaler, clipping, two backward passes per
    step: 90 % on the synthetic images in two epochs, one line per epoch from rank 0."""
    rc, stdout, stderr = example(
        2,
        "--data-dir",
        fashion,
        "--train-samples",
        "2000",
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--amp",
        "--accumulate",
        "2",
    )
    assert rc == 0, stderr
    assert len(accuracies(stdout)) == 2 and accuracies(stdout)[-1] >= 0.9, stdout


@pytest.mark.mpi
@needs_torch
def test_the_example_runs_lsgd_groups_and_batchnorm(fashion: str) -> None:
    """LSGD with a group per rank (delayed gradients), the ResNet's BatchNorm statistics
    averaged every step, three backward passes per step, on 3 ranks: it runs, one line
    per epoch. (The README runs it with D-PSGD on Fashion-MNIST.)"""
    samples = ["--train-samples", "96", "--test-samples", "50", "--epochs", "2", "--batch-size", "8"]
    rc, stdout, stderr = example(
        3,
        *["--algorithm", "lsgd", "--model", "resnet", "--accumulate", "3", "--data-dir", fashion, *samples],
        env={"MPIDL_RANKS_PER_NODE": "1"},
    )
    assert rc == 0, stderr
    assert len(accuracies(stdout)) == 2, stdout


@pytest.mark.mpi
@needs_torch
def test_without_the_data_the_example_says_how_to_get_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    """No IDX files in ``--data-dir``: the error names the folder and the three ways to get
    Fashion-MNIST (Debian's package, ``mpidl data fetch`` into that folder, ``--data-dir``)."""
    empty = on_rank0_quietly(lambda: str(tmp_path_factory.mktemp("empty")))
    rc, _, stderr = example(2, "--data-dir", empty)
    assert rc != 0, stderr
    assert (
        f"train-images-idx3-ubyte[.gz] not found in {empty}; get Fashion-MNIST's four IDX files one of three ways: "
        in stderr
    )
    ways = [
        "package dataset-fashion-mnist",
        f"'mpidl data fetch --dataset fashion-mnist --data-dir {empty}'",
        "--data-dir DIR",
    ]
    assert all(way in stderr for way in ways), stderr


def readme_diff() -> list[str]:
    """The lines of the diff block in README.rst's "Your own PyTorch script"."""
    text = (ROOT / "README.rst").read_text()
    section = text.split("Your own PyTorch script\n", 1)[1]
    block = section.split(".. code-block:: diff\n\n", 1)[1]
    lines = []
    for line in block.splitlines():
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    return [line for line in lines if line]


def test_the_readme_shows_the_lines_the_example_changed() -> None:
    """Every "+" line of the README's diff is a line of the example marked ``# mpidl`` (or a
    line moved in under one), every marked line is shown, no "-" line is left in the
    example, and the context lines are the example's; twelve lines changed."""
    source = [line.split(MARK)[0].rstrip() for line in EXAMPLE.read_text().splitlines()]
    marked = [line.split(MARK)[0].rstrip() for line in EXAMPLE.read_text().splitlines() if line.endswith(MARK)]
    diff = readme_diff()
    added = [line[1:] for line in diff if line.startswith("+")]
    removed = [line[1:] for line in diff if line.startswith("-")]
    context = [line[1:] for line in diff if line.startswith(" ")]
    assert len(diff) == len(added) + len(removed) + len(context)
    assert all(line in source for line in added + context), [line for line in added + context if line not in source]
    assert all(line not in source for line in removed)
    assert [line for line in added if line in marked] == marked
    moved = {line.strip() for line in added if line not in marked}  # the same code, indented anew
    assert moved <= {line.strip() for line in removed}
    assert len(marked) == 12
