"""The pieces of ``mpidl train`` that need no MPI job: data, models, option parsing;
and a damaged dataset file, named on every rank."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpidl import checkpoint, data, models
from mpidl.cli import build_parser
from mpidl.train import UsageError, config_from_args, parse_slow


@pytest.mark.parametrize("n,size", [(10, 1), (10, 3), (1437, 4), (7, 7), (100, 8)])
def test_shards_are_disjoint_and_cover_the_training_set(n: int, size: int) -> None:
    shards = [data.shard(n, r, size, seed=3) for r in range(size)]
    joined = np.concatenate(shards)
    assert sorted(joined.tolist()) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert all(np.array_equal(s, data.shard(n, r, size, seed=3)) for r, s in enumerate(shards))
    assert not np.array_equal(joined, np.concatenate([data.shard(n, r, size, seed=4) for r in range(size)]))


def test_shard_needs_a_sample_per_worker() -> None:
    with pytest.raises(data.DatasetError, match="3 training samples cannot be shared among 4 workers"):
        data.shard(3, 0, 4, seed=0)


def test_epoch_batches_use_every_sample_once_in_equal_step_counts() -> None:
    n, size, batch = 1437, 4, 32
    steps = data.steps_per_epoch(n, size, batch)
    assert steps == 12
    for rank in range(size):
        indices = data.shard(n, rank, size, seed=0)
        batches = data.epoch_batches(indices, steps, seed=0, epoch=1, rank=rank)
        assert len(batches) == steps and all(0 < len(b) <= batch for b in batches)
        assert sorted(np.concatenate(batches).tolist()) == sorted(indices.tolist())
        again = data.epoch_batches(indices, steps, seed=0, epoch=1, rank=rank)
        assert all(np.array_equal(a, b) for a, b in zip(batches, again))
        other = data.epoch_batches(indices, steps, seed=0, epoch=2, rank=rank)
        assert not np.array_equal(np.concatenate(batches), np.concatenate(other))


def test_steps_per_epoch_rejects_batches_that_cannot_be_filled() -> None:
    with pytest.raises(data.DatasetError, match="batch size of at least 2"):
        data.steps_per_epoch(9, 4, 1)
    with pytest.raises(data.DatasetError, match="at least 1"):
        data.steps_per_epoch(9, 4, 0)


def _write_idx(path, array: np.ndarray, code: int) -> None:
    blob = bytes([0, 0, code, array.ndim]) + np.array(array.shape, ">u4").tobytes() + array.tobytes()
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as f:
        f.write(blob)


def _write_fashion(folder) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A tiny Fashion-MNIST in ``folder``: images gzipped, labels raw (both forms are found)."""
    rng = np.random.default_rng(0)
    images = {s: rng.integers(0, 256, (n, 28, 28), dtype=np.uint8) for s, n in (("train", 6), ("t10k", 4))}
    labels = {s: rng.integers(0, 10, len(images[s]), dtype=np.uint8) for s in images}
    for split in images:
        _write_idx(folder / f"{split}-images-idx3-ubyte.gz", images[split], 0x08)
        _write_idx(folder / f"{split}-labels-idx1-ubyte", labels[split], 0x08)
    return images, labels


def test_fashion_mnist_reads_gzipped_and_raw_idx_files(tmp_path) -> None:
    images, labels = _write_fashion(tmp_path)
    ds = data.load_fashion_mnist(str(tmp_path))
    assert ds.x_train.shape == (6, 784) and ds.x_test.shape == (4, 784) and ds.features == 784
    assert ds.shape == (1, 28, 28)
    assert np.array_equal(ds.x_train, images["train"].reshape(6, -1))
    assert np.array_equal(ds.y_test, labels["t10k"]) and ds.y_test.dtype == np.int64
    norm = ds.normalized()
    assert norm.x_train.dtype == np.float32 and norm.x_train.min() >= 0 and norm.x_train.max() <= 1
    assert np.allclose(norm.x_train * 255, images["train"].reshape(6, -1))


def test_mnist_is_read_by_the_same_loader(tmp_path) -> None:
    """MNIST's four files have Fashion-MNIST's names and format: the same loader, its own name."""
    images, labels = _write_fashion(tmp_path)
    ds = data.DATASETS["mnist"](str(tmp_path))
    assert ds.name == "mnist" and ds.classes == 10 and ds.shape == (1, 28, 28)
    assert np.array_equal(ds.x_train, images["train"].reshape(6, -1)) and np.array_equal(ds.y_test, labels["t10k"])


@pytest.mark.parametrize(
    "name, ways",
    [
        (
            "fashion-mnist",
            [
                "one of three ways: Debian's package dataset-fashion-mnist installs them in {package}",
                "'mpidl data fetch --dataset fashion-mnist' downloads them and checks their SHA-256 (into {home}",
                "--data-dir DIR reads them from a folder of yours (torchvision's FashionMNIST(ROOT, download=True) "
                "puts them in ROOT/FashionMNIST/raw)",
            ],
        ),
        ("mnist", ["one of two ways: 'mpidl data fetch --dataset mnist' downloads them", "--data-dir DIR reads"]),
    ],
)
def test_missing_idx_files_say_how_to_get_them(
    name: str, ways: list[str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the files, the error names where it looked and the ways to get them (Debian's
    package where there is one, ``mpidl data fetch``, ``--data-dir``); with a ``--data-dir``
    the fetch goes there. The package's folder is moved to one that does not exist (where the
    package is installed, as in CI, the files would be found)."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    home = f"{tmp_path}/mpidl/{name}"
    package = str(tmp_path / "package")
    source = data.IDX_DATASETS[name]
    if source.package_dir:
        monkeypatch.setitem(data.IDX_DATASETS, name, dataclasses.replace(source, package_dir=package))
    with pytest.raises(data.DatasetError) as exc:
        data.load_idx(name)
    message = str(exc.value)
    assert message.startswith(f"train-images-idx3-ubyte[.gz] not found in {' or '.join(data.default_dirs(name))}; ")
    assert data.default_dirs(name)[-1] == home
    assert all(way.format(home=home, package=package) in message for way in ways), message
    with pytest.raises(
        data.DatasetError, match=rf"'mpidl data fetch --dataset {name} --data-dir /none' .* \(into /none\)"
    ):
        data.load_idx(name, "/none")


def test_without_a_data_dir_the_fetched_files_are_found(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files in the user's data folder (where ``mpidl data fetch`` puts them) are read when no
    folder is given; a folder holding some of them is the one whose missing file is named."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    folder = tmp_path / "mpidl" / "mnist"
    folder.mkdir(parents=True)
    images, _ = _write_fashion(folder)
    assert np.array_equal(data.load_idx("mnist").x_test, images["t10k"].reshape(4, -1))
    (folder / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(data.DatasetError, match=rf"t10k-labels-idx1-ubyte\[.gz\] not found in {folder}; get MNIST"):
        data.load_idx("mnist")


def test_idx_errors_are_clear(tmp_path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(data.DatasetError, match="not an IDX file"):
        data.read_idx(str(tmp_path / "bad"))
    _write_idx(tmp_path / "short", np.zeros((3, 2), np.uint8), 0x08)
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(data.DatasetError, match=r"short: truncated \(17 bytes; the IDX header says 18"):
        data.read_idx(str(tmp_path / "short"))
    _write_idx(tmp_path / "wide", np.arange(6, dtype=">i4").reshape(2, 3), 0x0C)
    assert data.read_idx(str(tmp_path / "wide")).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(data.DatasetError, match=r"train-images-idx3-ubyte.*not found"):
        data.load_fashion_mnist(str(tmp_path))


def _truncate(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _flip_byte(path, at: int, blob: bytes | None = None) -> None:
    """Write ``blob`` (default: the file's bytes) to ``path`` with byte ``at`` inverted."""
    damaged = bytearray(path.read_bytes() if blob is None else blob)
    damaged[at] ^= 0xFF
    path.write_bytes(bytes(damaged))


def _labels(path, labels: list[int]) -> None:
    _write_idx(path, np.array(labels, np.uint8), 0x08)


#: Damage done to one file of :func:`_write_fashion`'s dataset, and the problem that names it.
DAMAGE = {
    "truncated-gzip": (
        "train-images-idx3-ubyte.gz",
        lambda p: _truncate(p, 3000),
        "truncated (the gzip stream ends before its end marker)",
    ),
    "corrupt-gzip": ("t10k-images-idx3-ubyte.gz", lambda p: _flip_byte(p, 1500), "corrupt gzip file (CRC check failed"),
    "corrupt-deflate": (  # the first deflate block's header: the 10-byte gzip header of gzip.compress precedes it
        "t10k-images-idx3-ubyte.gz",
        lambda p: _flip_byte(p, 10, gzip.compress(gzip.decompress(p.read_bytes()))),
        "corrupt gzip file (Error -3 while decompressing data: invalid block type)",
    ),
    "not-gzip": ("train-images-idx3-ubyte.gz", lambda p: p.write_bytes(b"\0\0\x08\x01" * 8), "corrupt gzip file"),
    "truncated-idx": (
        "train-labels-idx1-ubyte",
        lambda p: _truncate(p, 10),
        "truncated (10 bytes; the IDX header says 14",
    ),
    "bad-magic": ("t10k-labels-idx1-ubyte", lambda p: _flip_byte(p, 0), "not an IDX file (bad magic number)"),
    "counts": ("t10k-labels-idx1-ubyte", lambda p: _labels(p, [1, 2, 3]), "holds 4 images, "),
    "labels": (
        "t10k-labels-idx1-ubyte",
        lambda p: _labels(p, [1, 9, 10, 255]),
        "2 label(s) outside the classes 0..9 (first: 10 at index 2)",
    ),
}


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_fashion_mnist_file_is_named_on_every_rank(damage: str, tmp_path) -> None:
    """Rank 0 reads the files; what is wrong with one of them is every rank's DatasetError."""
    comm = MPI.COMM_WORLD
    name, spoil, problem = DAMAGE[damage]
    folder = comm.bcast(tmp_path)  # rank 0's
    if comm.Get_rank() == 0:
        _write_fashion(folder)
        spoil(folder / name)
    with pytest.raises(data.DatasetError) as exc:
        data.load("fashion-mnist", str(folder), comm)
    assert str(folder / name) in str(exc.value) and problem in str(exc.value), exc.value


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
def test_digits_split_is_fixed_and_stratified() -> None:
    a, b = data.load_digits(), data.load_digits()
    assert len(a.y_train) == 1437 and len(a.y_test) == 360 and a.features == 64
    assert np.array_equal(a.x_test, b.x_test) and np.array_equal(a.y_train, b.y_train)
    assert np.bincount(a.y_test, minlength=10).min() >= 35


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
def test_digits_split_is_kept_in_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load keeps the split; later loads read it (scikit-learn not called) and
    get the same arrays; a damaged file is made anew; a folder that cannot be written
    only costs the split each time."""
    monkeypatch.setenv("MPIDL_CACHE_DIR", str(tmp_path / "cache"))
    split = data._split_digits
    splits: list[int] = []
    monkeypatch.setattr(data, "_split_digits", lambda: splits.append(1) or split())
    first = data.load_digits()
    path = Path(data.digits_cache())
    assert path.is_file() and len(splits) == 1
    fields = ("x_train", "y_train", "x_test", "y_test")
    for damage in (None, path.read_bytes()[: path.stat().st_size // 2], b"not a zip file"):
        if damage is not None:
            path.write_bytes(damage)
        again = data.load_digits()
        assert all(np.array_equal(getattr(first, k), getattr(again, k)) for k in fields)
        assert all(getattr(first, k).dtype == getattr(again, k).dtype for k in fields)
    assert len(splits) == 3 and path.stat().st_size > len(damage) and os.listdir(path.parent) == [path.name]
    (tmp_path / "a file").write_bytes(b"")
    monkeypatch.setenv("MPIDL_CACHE_DIR", str(tmp_path / "a file"))
    assert np.array_equal(data.load_digits().x_test, first.x_test) and len(splits) == 4


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn")
def test_subsets_are_fixed_and_checked() -> None:
    full = data.load_digits()
    a, b = full.subset(100, 50), full.subset(100, 50)
    assert (len(a.y_train), len(a.y_test), a.shape) == (100, 50, (1, 8, 8))
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    assert full.subset(None, 50).x_train is full.x_train and len(np.unique(a.y_train)) == 10
    rows = {r.tobytes() for r in full.x_train}
    assert all(r.tobytes() in rows for r in a.x_train)
    with pytest.raises(data.DatasetError, match="digits has 360 test samples; cannot take 361"):
        full.subset(None, 361)


def test_numpy_mlp_gradient_matches_finite_differences() -> None:
    net = models.NumpyMLP((5, 4, 3, 3), seed=1, dtype=np.float64)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(7, 5)), rng.integers(0, 3, 7)
    grad = np.empty_like(net.params)
    loss = net.loss_and_grad(net.params, x, y, grad)
    assert loss == pytest.approx(net.evaluate(net.params, x, y)[0] / len(y))
    eps, numeric = 1e-6, np.empty_like(grad)
    for i in range(net.params.size):
        shifted = net.params.copy()
        shifted[i] += eps
        up = net.evaluate(shifted, x, y)[0]
        shifted[i] -= 2 * eps
        numeric[i] = (up - net.evaluate(shifted, x, y)[0]) / (2 * eps * len(y))
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)


def test_init_follows_torch_linear_bounds() -> None:
    sizes = (64, 32, 10)
    flat = models.init_params(sizes, seed=0)
    net = models.NumpyMLP(sizes, seed=0)
    assert np.array_equal(net.params, flat) and flat.dtype == np.float32 and net.parameters == flat.size
    for (w, b), fan_in in zip(net.layers(flat), sizes[:-1]):
        bound = 1 / np.sqrt(fan_in)
        assert np.abs(w).max() <= bound and np.abs(b).max() <= bound and np.abs(w).max() > 0.9 * bound


def test_torch_and_numpy_mlps_agree() -> None:
    torch = pytest.importorskip("torch")
    sizes = (6, 5, 4)
    tnet, nnet = models.make("mlp", (1, 2, 3), 4, hidden=(5,), backend="torch", seed=3), models.NumpyMLP(sizes, seed=3)
    flat = torch.nn.utils.parameters_to_vector(tnet.model.parameters()).detach()
    assert np.array_equal(flat.numpy(), nnet.params)
    rng = np.random.default_rng(4)
    x, y = rng.random((9, 6), dtype=np.float32), rng.integers(0, 4, 9)
    loss = float(tnet.loss_backward(tnet.array(x), tnet.array(y)))
    grad = torch.cat([p.grad.reshape(-1) for p in tnet.model.parameters()]).numpy()
    nnet.make_optimizer(lr=0.1, momentum=0.0)
    assert loss == pytest.approx(nnet.loss_backward(x, y), rel=1e-5)
    np.testing.assert_allclose(grad, nnet.optimizer.grad, rtol=1e-4, atol=1e-6)
    t_loss, t_correct = tnet.evaluate(flat, tnet.array(x), tnet.array(y))
    n_loss, n_correct = nnet.evaluate(nnet.params, x, y)
    assert t_loss == pytest.approx(n_loss, rel=1e-5) and t_correct == n_correct


def test_model_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="numpy backend runs on the CPU only"):
        models.make("mlp", (1, 2, 2), 2, backend="numpy", device="cuda")
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        models.make("mlp", (1, 2, 2), 2, backend="jax")
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        models.make("vgg", (1, 2, 2), 2)
    with pytest.raises(ValueError, match="the lenet model needs the torch backend"):
        models.make("lenet", (1, 28, 28), 10, backend="numpy")
    with pytest.raises(ValueError, match="an MLP needs at least two layer sizes, all positive"):
        models.make("mlp", (1, 2, 2), 2, hidden=(0,), backend="numpy")


def test_cnns_have_their_documented_sizes() -> None:
    pytest.importorskip("torch")
    lenet, resnet = (models.make(k, (1, 28, 28), 10, backend="torch") for k in ("lenet", "resnet"))
    assert (lenet.name, lenet.parameters) == ("LeNet-5", 61706)
    assert (resnet.name, resnet.parameters) == ("ResNet-8 (32-64-128)", 308074)
    statistics = [b for b in resnet.model.buffers() if b.is_floating_point()]
    assert sum(b.numel() for b in statistics) == 1344
    assert models.make("resnet", (1, 8, 8), 10, backend="torch").parameters == 308074
    with pytest.raises(ValueError, match="LeNet-5 needs images of at least 12x12, the dataset's are 8x8"):
        models.make("lenet", (1, 8, 8), 10, backend="torch")


def test_cnns_start_from_the_seed() -> None:
    torch = pytest.importorskip("torch")
    for kind in ("lenet", "resnet"):
        a, b, c = (models.make(kind, (1, 28, 28), 10, backend="torch", seed=s) for s in (1, 1, 2))
        va, vb, vc = (torch.nn.utils.parameters_to_vector(m.model.parameters()) for m in (a, b, c))
        assert torch.equal(va, vb) and not torch.equal(va, vc)


def test_evaluation_reads_the_given_state_batchnorm_statistics_included() -> None:
    """The ResNet evaluated on its flat state (algorithms.flat: parameters, then BatchNorm
    statistics) agrees with the module in eval mode; statistics changed in the given state
    change the result; the module's own tensors and training mode are left alone."""
    torch = pytest.importorskip("torch")
    import algorithms

    net = models.make("resnet", (1, 8, 8), 3, backend="torch", seed=0)
    opt = net.make_optimizer(0.1, 0.0)
    flat = algorithms.flatten(net.model, opt)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.rand(20, 64, generator=generator), torch.randint(0, 3, (20,), generator=generator)
    net.model.train()
    net.loss_backward(x, y)  # one forward pass in training mode moves the running statistics
    before = flat.state.clone()
    loss, correct = net.evaluate(flat.state, x, y)
    net.model.eval()
    with torch.no_grad():
        logits = net.model(x)
    net.model.train()
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")), rel=1e-5)
    assert correct == int((logits.argmax(1) == y).sum())
    other = flat.state.clone()
    other[flat.size :] += 5  # shift the running means and variances
    assert net.evaluate(other, x, y)[0] != pytest.approx(loss, rel=1e-5)  # beyond rounding
    assert torch.equal(flat.state, before) and net.model.training


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def test_slow_parsing() -> None:
    assert parse_slow("3:4") == (3, 4.0) and parse_slow("0:1.5") == (0, 1.5)
    for bad in ("3", "3:", ":4", "a:2", "3:x", "-1:2", "2:0.5", "2:nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="bad --slow"):
            parse_slow(bad)
    assert config_from_args(_args("--slow", "1:2", "--slow", "3:4")).slow == {1: 2.0, 3: 4.0}
    with pytest.raises(UsageError, match="--slow given twice for rank 1"):
        config_from_args(_args("--slow", "1:2", "--slow", "1:3"))


def test_algorithm_options_go_to_the_algorithms_that_take_them() -> None:
    cfg = config_from_args(_args("--algorithm", "lsgd", "--collective", "ring", "--layout", "2"))
    assert cfg.options == {"collective": "ring", "layout": "2"}
    assert config_from_args(_args("--algorithm", "dpsgd", "--topology", "torus")).options == {"topology": "torus"}
    assert config_from_args(_args("--algorithm", "allreduce")).options == {}
    with pytest.raises(UsageError, match="--topology does not apply to --algorithm allreduce"):
        config_from_args(_args("--algorithm", "allreduce", "--topology", "ring"))
    with pytest.raises(UsageError, match="--topology does not apply to --algorithm allreduce"):
        config_from_args(_args("--topology", "ring"))  # the default algorithm
    with pytest.raises(UsageError, match="--collective does not apply to --algorithm dpsgd"):
        config_from_args(_args("--algorithm", "dpsgd", "--collective", "ring"))
    assert config_from_args(
        _args("--algorithm", "prague", "--policy", "random", "--group-size", "3", "--local-steps", "2")
    ).options == {"policy": "random", "group_size": 3, "local_steps": 2}
    assert config_from_args(_args("--algorithm", "grsgd", "--max-lead", "0")).options == {"max_lead": 0}
    assert config_from_args(_args("--algorithm", "adpsgd", "--topology", "bipartite")).options == {
        "topology": "bipartite"
    }
    with pytest.raises(UsageError, match="--max-lead does not apply to --algorithm adpsgd"):
        config_from_args(_args("--algorithm", "adpsgd", "--max-lead", "1"))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--algorithm", "nope"], "invalid choice: 'nope'"),
        (["--epochs", "0"], "expected a positive int"),
        (["--lr", "-1"], "expected a number >= 0"),
        (["--hidden", "64,x"], "expected a positive int"),
        (["--max-lead", "-1"], "expected an integer >= 0"),
        (["--policy", "fastest"], "invalid choice: 'fastest'"),
    ],
)
def test_bad_values_are_refused_by_the_parser(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _args(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    from mpi4py import MPI

    assert message in err if MPI.COMM_WORLD.Get_rank() == 0 else err == ""


def test_checkpoints_keep_the_two_newest_and_drop_those_of_an_abandoned_continuation(tmp_path) -> None:
    """Complete checkpoints after steps 10 and 20, a job killed while writing step 30: resumed
    from 20, its checkpoint after step 25 removes the half-written 30 and the oldest, 10."""
    for step in (10, 20):
        checkpoint.save(str(tmp_path), step, MPI.COMM_SELF, {"x": np.full(3, step)}, {"step": step})
    (tmp_path / "step-000030").mkdir()
    (tmp_path / "step-000030" / ".tmp-half-written").write_bytes(b"\0" * 10)
    assert checkpoint.load(str(tmp_path), 0)[1] == {"step": 20}
    checkpoint.save(str(tmp_path), 25, MPI.COMM_SELF, {"x": np.full(3, 25)}, {"step": 25})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000020", "step-000025"]
    arrays, info = checkpoint.load(str(tmp_path), 0)
    assert info == {"step": 25} and arrays["x"].tolist() == [25] * 3


def _save(folder, step: int) -> None:
    checkpoint.save(str(folder), step, MPI.COMM_SELF, {"x": np.full(3, step)}, {"step": step})


def _steps(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != "latest")


def test_checkpoints_are_pruned_by_their_step_numbers(tmp_path) -> None:
    """From 999,999 to 1,000,000 the names gain a digit: the two newest stay all the same, and
    a run resumed from 999,999 that left 1,000,000 and a half-written 1,000,001 behind keeps
    the checkpoint it resumed from."""
    for step in (999_998, 999_999, 1_000_000):
        _save(tmp_path, step)
    assert _steps(tmp_path) == ["step-1000000", "step-999999"]
    assert checkpoint.load(str(tmp_path), 0)[1] == {"step": 1_000_000}
    (tmp_path / "step-1000001").mkdir()
    (tmp_path / "latest").write_text("step-999999")  # the run resumed from there
    _save(tmp_path, 1_000_000)
    assert _steps(tmp_path) == ["step-1000000", "step-999999"]
    _save(tmp_path, 1_000_001)
    assert _steps(tmp_path) == ["step-1000000", "step-1000001"]
    assert checkpoint.load(str(tmp_path), 0)[1] == {"step": 1_000_001}


def test_a_checkpoint_removes_the_temporary_files_of_killed_writers(tmp_path) -> None:
    """A job killed while writing ``latest`` and a worker killed while writing step 20's file
    left temporary files; the next checkpoint (step 20 again) removes them."""
    _save(tmp_path, 10)
    (tmp_path / ".tmp-latest-of-a-killed-job").write_bytes(b"step-0")
    (tmp_path / "step-000020").mkdir()
    (tmp_path / "step-000020" / ".tmp-rank-of-a-killed-job").write_bytes(b"\0" * 10)
    _save(tmp_path, 20)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["latest", "step-000010", "step-000010/rank-0.npz", "step-000020", "step-000020/rank-0.npz"]


def test_a_checkpoint_is_durable_before_latest_names_it(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file is fsynced before its rename and its folder after it: the worker's file in the
    step folder, then ``latest`` in the checkpoint folder (which holds the step folder's entry)."""
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def recorded_replace(src: str, dst: str) -> None:
        replace(src, dst)
        events.append(("replace", os.stat(dst).st_ino))

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    _save(tmp_path, 10)
    file, folder = tmp_path / "step-000010" / "rank-0.npz", tmp_path / "step-000010"
    latest = tmp_path / "latest"
    assert events == [
        ("fsync", file.stat().st_ino),
        ("replace", file.stat().st_ino),
        ("fsync", folder.stat().st_ino),
        ("fsync", latest.stat().st_ino),
        ("replace", latest.stat().st_ino),
        ("fsync", tmp_path.stat().st_ino),
    ]


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_write_fails_the_checkpoint_on_every_rank(tmp_path, monkeypatch) -> None:
    """The last rank's disk is full: every rank raises, naming it, ``latest`` keeps naming the
    checkpoint before, and the next checkpoint is written (before, the others went on)."""
    comm = MPI.COMM_WORLD
    folder = comm.bcast(str(tmp_path), root=0)
    checkpoint.save(folder, 10, comm, {"x": np.full(3, 10)}, {"step": 10})
    savez = np.savez

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if comm.rank == comm.size - 1:
        monkeypatch.setattr(np, "savez", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.save(folder, 20, comm, {"x": np.full(3, 20)}, {"step": 20})
    assert str(exc.value) == (
        f"the checkpoint after step 20 in {folder} was not written: rank {comm.size - 1}: "
        "OSError: [Errno 28] No space left on device ('latest' names the one before)"
    )
    assert checkpoint.load(folder, comm.rank)[1] == {"step": 10}
    monkeypatch.setattr(np, "savez", savez)
    checkpoint.save(folder, 20, comm, {"x": np.full(3, 20)}, {"step": 20})
    assert checkpoint.load(folder, comm.rank)[1] == {"step": 20}
    comm.Barrier()  # rank 0's tmp_path outlives every rank's use of it


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda p: _truncate(p, 100), "is truncated or corrupt (BadZipFile: File is not a zip file)"),
        (lambda p: _truncate(p, 0), "is truncated or corrupt (EOFError: No data left in file)"),
        (lambda p: _flip_byte(p, 200), "is truncated or corrupt (BadZipFile: Bad CRC-32 for file 'x.npy')"),
        (lambda p: p.write_bytes(b"garbage" * 100), "is truncated or corrupt (ValueError: "),
        (lambda p: np.savez(p, x=np.arange(3)), "is truncated or corrupt (KeyError: 'info')"),
        (lambda p: np.savez(p, info=np.array("[1]")), "is corrupt (its 'info' is not a JSON object)"),
    ],
    ids=["truncated", "empty", "flipped", "garbage", "no-info", "info-not-an-object"],
)
def test_a_damaged_checkpoint_file_is_named(damage, problem: str, tmp_path) -> None:
    checkpoint.save(str(tmp_path), 7, MPI.COMM_SELF, {"x": np.arange(3.0)}, {"step": 7})
    path = tmp_path / "step-000007" / "rank-0.npz"
    damage(path)
    with pytest.raises(checkpoint.CheckpointError) as exc:
        checkpoint.load(str(tmp_path), 0)
    assert str(exc.value).startswith(f"{path} {problem}"), exc.value
