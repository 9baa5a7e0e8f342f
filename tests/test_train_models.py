"""``mpidl train`` with the CNNs and with the peer (PyTorch DDP) under its own mpiexec.

The CNNs train on a small synthetic Fashion-MNIST written as IDX files (28x28
images whose class is a bright bar at a class-dependent row, under noise), so
that the tests need no dataset package and a few steps reach a high accuracy.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from mpitest import on_rank0_quietly
from test_train import train

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the CNNs and DDP need torch"),
]

QUICK = ["--epochs", "2", "--no-progress"]
HOROVOD = importlib.util.find_spec("horovod") is not None


def _write_idx(path: Path, array: np.ndarray) -> None:
    code = 0x08  # unsigned bytes
    path.write_bytes(bytes([0, 0, code, array.ndim]) + np.array(array.shape, ">u4").tobytes() + array.tobytes())


def synthetic_fashion(folder: Path, train_n: int = 2000, test_n: int = 200) -> str:
    """Write a learnable 10-class, 28x28 dataset in Fashion-MNIST's file names; return the folder."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train_n), ("t10k", test_n)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = rng.integers(0, 90, (n, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            images[i, 2 + 2 * label : 4 + 2 * label, 4:24] = 250
        _write_idx(folder / f"{split}-images-idx3-ubyte", images)
        _write_idx(folder / f"{split}-labels-idx1-ubyte", labels)
    return str(folder)


@pytest.fixture(scope="module")
def fashion(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("fashion")
    return on_rank0_quietly(synthetic_fashion, folder)


def read(path: Path) -> dict:
    return on_rank0_quietly(lambda: json.loads(path.read_text()))


@pytest.mark.parametrize(
    "model,algorithm,samples,state_floats",
    [("lenet", "allreduce", 2000, 0), ("resnet", "dpsgd", 1200, 1344), ("resnet", "allreduce", 1200, 1344)],
)
def test_cnns_learn_and_their_batchnorm_statistics_follow_the_algorithm(
    model: str,
    algorithm: str,
    samples: int,
    state_floats: int,
    fashion: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """LeNet-5 and ResNet-8 reach 90 % on the synthetic images in two epochs. D-PSGD
    sends the whole state (parameters and BatchNorm statistics) to its two ring
    neighbours; AllReduce-SGD all-reduces the gradients only, so the workers hold the
    same parameters (consensus 0) and each keeps its own statistics."""
    out = tmp_path_factory.mktemp(model) / "run.json"
    rc, stdout, stderr = train(
        4,
        "--model",
        model,
        "--algorithm",
        algorithm,
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        fashion,
        "--train-samples",
        str(samples),
        "--batch-size",
        "16",
        "--json",
        str(out),
        *QUICK,
    )
    assert rc == 0, stderr
    run = read(out)
    meta, last = run["meta"], run["epochs"][-1]
    assert meta["model_spec"] == {"model": model, "input": [1, 28, 28]} and meta["backend"] == "torch"
    assert last["test_acc"] >= 0.9, stdout
    state_bytes = meta["model_bytes"] + 4 * state_floats
    if algorithm == "dpsgd":
        assert last["bytes_per_step_mean"] == 2 * state_bytes and 0 < last["consensus"] < 0.05
    else:
        assert last["consensus"] == 0 and last["bytes_per_step_max"] <= 2 * meta["model_bytes"]


def test_ddp_takes_the_steps_of_allreduce_sgd(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The peer in the same harness: DDP over gloo and mpidl's AllReduce-SGD start from the
    same model, see the same batches and average the same gradients, so their losses and
    accuracies agree to the rounding of two different summation orders."""
    out = tmp_path_factory.mktemp("ddp")
    runs = {}
    for algorithm in ("allreduce", "ddp"):
        path = out / f"{algorithm}.json"
        rc, _stdout, stderr = train(
            2, "--algorithm", algorithm, "--backend", "torch", "--hidden", "32", "--json", str(path), *QUICK
        )
        assert rc == 0, stderr
        runs[algorithm] = read(path)
    assert runs["ddp"]["meta"]["algorithm"] == "ddp"
    for mine, theirs in zip(runs["allreduce"]["epochs"], runs["ddp"]["epochs"]):
        assert theirs["train_loss"] == pytest.approx(mine["train_loss"], rel=1e-4)
        assert abs(theirs["test_acc"] - mine["test_acc"]) <= 1 / 360 and theirs["consensus"] == 0
        assert theirs["bytes_per_step_mean"] == mine["bytes_per_step_mean"]  # 2 (n-1)/n x model on 2 ranks


@pytest.mark.skipif(not HOROVOD, reason="Horovod is not installed (jobs/peers/horovod.sh builds it)")
def test_horovod_takes_the_steps_of_allreduce_sgd(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The other peer: Horovod's DistributedOptimizer over MPI averages the same gradients as
    AllReduce-SGD (to the rounding of another summation order); with fp16 it sends half."""
    out = tmp_path_factory.mktemp("horovod")
    runs = {}
    for name, argv in {
        "allreduce": ["--algorithm", "allreduce"],
        "horovod": ["--algorithm", "horovod"],
        "horovod+fp16": ["--algorithm", "horovod", "--compression", "fp16"],
    }.items():
        path = out / f"{name}.json"
        rc, _stdout, stderr = train(2, *argv, "--backend", "torch", "--hidden", "32", "--json", str(path), *QUICK)
        assert rc == 0, stderr
        runs[name] = read(path)
    assert runs["horovod"]["meta"]["algorithm"] == "horovod"
    epochs = zip(runs["allreduce"]["epochs"], runs["horovod"]["epochs"], runs["horovod+fp16"]["epochs"])
    for mine, theirs, half in epochs:
        assert theirs["train_loss"] == pytest.approx(mine["train_loss"], rel=1e-4)
        assert abs(theirs["test_acc"] - mine["test_acc"]) <= 1 / 360 and theirs["consensus"] == 0
        assert half["train_loss"] == pytest.approx(mine["train_loss"], rel=1e-2) and half["consensus"] == 0
        assert theirs["bytes_per_step_mean"] == mine["bytes_per_step_mean"] == 2 * half["bytes_per_step_mean"]


@pytest.mark.skipif(HOROVOD, reason="Horovod is installed")
def test_horovod_missing_is_reported_once() -> None:
    rc, _stdout, stderr = train(2, "--algorithm", "horovod", "--backend", "torch", "--no-progress")
    message = "horovod is not installed (jobs/peers/horovod.sh builds it for this torch and MPI)"
    assert rc == 2 and stderr.count(message) == 1 and "Traceback" not in stderr, stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--algorithm", "ddp", "--backend", "numpy"], "ddp trains torch models only (use --backend torch)"),
        (
            ["--algorithm", "horovod", "--compression", "powersgd:4"],
            "horovod compresses with hvd.Compression.fp16 only: compression fp16, not 'powersgd:4'",
        ),
        (["--model", "lenet", "--backend", "numpy"], "the lenet model needs the torch backend"),
        (["--model", "lenet"], "LeNet-5 needs images of at least 12x12, the dataset's are 8x8"),
        (["--train-samples", "5000"], "digits has 1437 train samples; cannot take 5000"),
    ],
)
def test_model_and_peer_errors_are_reported_once(argv: list[str], message: str) -> None:
    rc, _stdout, stderr = train(2, *argv, "--no-progress")
    assert rc == 2 and stderr.count(message) == 1 and "Traceback" not in stderr, stderr
