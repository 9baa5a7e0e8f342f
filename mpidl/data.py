"""Datasets for ``mpidl train``: loading, the train/test split, shards and batches;
shards of a user's own dataset for a torch ``DataLoader``.

Datasets (:data:`DATASETS`); features are flattened images scaled to [0, 1]
as float32, labels int64:

* ``digits``: scikit-learn's bundled ``load_digits`` (1,797 8x8 images of
  handwritten digits, 10 classes; no download). Train/test split: a
  stratified 80/20 split (``train_test_split``) with the fixed seed
  :data:`SPLIT_SEED`, the same whatever the training seed.
* ``fashion-mnist``: Zalando's Fashion-MNIST (70,000 28x28 images of
  clothes, 10 classes) and ``mnist``: LeCun, Cortes and Burges' MNIST
  (70,000 28x28 images of handwritten digits, 10 classes), each from its
  four IDX files, gzipped or raw (``train-images-idx3-ubyte[.gz]``,
  ``train-labels-idx1-ubyte[.gz]``, ``t10k-images-idx3-ubyte[.gz]``,
  ``t10k-labels-idx1-ubyte[.gz]``), with its own 60,000/10,000 split
  (:func:`load_idx`). They are read from ``--data-dir``, or else from the
  first of :func:`default_dirs` that holds them: where a distribution's
  package installs them (Debian's ``dataset-fashion-mnist``:
  :data:`FASHION_MNIST_DIR`), then where ``mpidl data fetch`` puts them
  (:func:`user_dir`; :mod:`mpidl.fetch` downloads them and checks their
  SHA-256, :data:`IDX_DATASETS`). Files not found are a
  :class:`DatasetError` that says how to get them; a file truncated or
  corrupt, counts that disagree or labels outside 0..9 one naming the file,
  on every rank (:func:`load`).

Subsets (``--train-samples``, ``--test-samples``; :meth:`Dataset.subset`):
the first N samples of each split in a fixed order, the same for every run,
for quick runs of the larger models.

Sharding (:func:`shard`): the training samples are permuted once with the
training seed and cut into n nearly equal contiguous parts, one per worker
(``numpy.array_split``): disjoint, covering, sizes differing by at most one.

Batches (:func:`epoch_batches`): each epoch, worker r shuffles its shard with
a generator seeded by (seed, epoch, r) alone, so a run is reproducible and an
epoch can be regenerated without replaying the ones before it. Every worker
takes the same number of steps per epoch, ceil(largest shard / batch size)
(synchronous algorithms need equal counts); its shuffled shard is cut into
that many consecutive batches of nearly equal size (at most the batch size,
differing by at most one), so every sample is used once per epoch.
Asynchronous training lets fast workers take more steps than that
(:mod:`mpidl.pacing`): a worker that has used its shard goes on with another
sweep over it, shuffled anew (:func:`batch_stream`).

A user's own dataset (:class:`ShardSampler`): the same shards and the same
order in an epoch, as indices for ``torch.utils.data.DataLoader(dataset,
batch_size, sampler=...)``, whose batches then have the usual fixed size.
Shards differ in size by one at most; so that every worker takes the same
number of steps, each yields the same number of indices, like PyTorch's
``DistributedSampler``: ceil(N / n), a worker with a smaller shard repeating
the first index of its epoch's order (``drop_last=False``, so that every
sample is used every epoch), or floor(N / n), a worker with a larger shard
leaving out the last index of its epoch's order (``drop_last=True``, so
that no sample is used twice; a different one each epoch).
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import math
import operator
import os
import zipfile
import zlib
from collections.abc import Iterator, Sized
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from mpi4py import MPI

from collectives.tuning import cache

from . import checkpoint

#: Seed of the digits train/test split (fixed, so every run tests on the same images).
SPLIT_SEED = 0
#: Fraction of the digits held out for testing.
TEST_FRACTION = 0.2
#: The digits' split, (dtype, shape) of x_train, y_train, x_test, y_test.
DIGITS_SPLIT = [
    (np.dtype(np.uint8), (1437, 64)),
    (np.dtype(np.int64), (1437,)),
    (np.dtype(np.uint8), (360, 64)),
    (np.dtype(np.int64), (360,)),
]
#: Where the Debian package ``dataset-fashion-mnist`` installs the IDX files.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
#: The classes of the IDX datasets: labels are 0..9.
IDX_CLASSES = 10
#: The four files of an IDX dataset, without their ``.gz``.
IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@dataclass(frozen=True)
class IdxSource:
    """Where an IDX dataset's files come from.

    Attributes:
        title: the dataset's name in messages.
        sha256: the SHA-256 of each official gzipped file, by file name.
        mirrors: URLs (ending in "/") that serve the files, in the order to try them.
        torchvision: the class of ``torchvision.datasets`` that downloads the same files
            (into ``ROOT/<class>/raw``).
        package, package_dir: a Debian package that installs the files, and where (None: none).
    """

    title: str
    sha256: dict[str, str]
    mirrors: tuple[str, ...]
    torchvision: str
    package: str | None = None
    package_dir: str | None = None


#: The IDX datasets, their official files' SHA-256 (as torchvision lists them:
#: ``torchvision/prototype/datasets/_builtin/mnist.py``) and where to download them.
IDX_DATASETS = {
    "fashion-mnist": IdxSource(
        "Fashion-MNIST",
        {
            "train-images-idx3-ubyte.gz": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
            "train-labels-idx1-ubyte.gz": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
            "t10k-images-idx3-ubyte.gz": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
            "t10k-labels-idx1-ubyte.gz": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
        },
        (
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",  # Zalando's, as its README gives it
            "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
        ),
        "FashionMNIST",
        package="dataset-fashion-mnist",
        package_dir=FASHION_MNIST_DIR,
    ),
    "mnist": IdxSource(
        "MNIST",
        {
            "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        },
        (
            "https://ossci-datasets.s3.amazonaws.com/mnist/",  # PyTorch's mirror
            "https://storage.googleapis.com/cvdf-datasets/mnist/",  # TensorFlow's
        ),
        "MNIST",
    ),
}

# Keys that keep the generators of the shard permutation and of each epoch's order apart.
_SHARD_STREAM, _EPOCH_STREAM = 0, 1


class DatasetError(ValueError):
    """A dataset that cannot be loaded (missing files, bad format, unknown name)."""


@dataclass(frozen=True)
class Dataset:
    """A classification dataset split into train and test.

    Attributes:
        name: the dataset's name in :data:`DATASETS`.
        x_train, x_test: samples x features; raw pixels as loaded, float32 in
            [0, 1] after :meth:`normalized`.
        y_train, y_test: class labels, int64.
        classes: number of classes.
        pixel_max: the raw pixels' full scale (16 for digits, 255 for Fashion-MNIST).
        shape: the image shape (channels, height, width) of a sample's features.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: int
    pixel_max: float
    shape: tuple[int, int, int]

    @property
    def features(self) -> int:
        """Number of features per sample."""
        return int(self.x_train.shape[1])

    def subset(self, train: int | None = None, test: int | None = None) -> Dataset:
        """The dataset cut to its first ``train`` training and ``test`` test samples in an
        order fixed by :data:`SPLIT_SEED` (None: all), the same for every run.

        Raises:
            DatasetError: a count below 1 or above what the dataset has.
        """
        parts = {}
        for split, count in (("train", train), ("test", test)):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if count is not None:
                if not 1 <= count <= len(y):
                    raise DatasetError(f"{self.name} has {len(y)} {split} samples; cannot take {count}")
                keep = np.sort(np.random.default_rng([SPLIT_SEED, len(y)]).permutation(len(y))[:count])
                x, y = x[keep], y[keep]
            parts[f"x_{split}"], parts[f"y_{split}"] = x, y
        return replace(self, **parts)

    def normalized(self) -> Dataset:
        """The dataset with float32 features in [0, 1]."""
        scale = np.float32(1.0 / self.pixel_max)
        return replace(
            self,
            x_train=self.x_train.astype(np.float32) * scale,
            x_test=self.x_test.astype(np.float32) * scale,
            pixel_max=1.0,
        )


def load_digits() -> Dataset:
    """scikit-learn's bundled digits, split 80/20 (stratified, seed :data:`SPLIT_SEED`).

    The split is kept in :func:`digits_cache` after the first load and read from
    there afterwards: importing scikit-learn takes longer than a short run's
    training. A cache that is missing, unreadable or not the digits' split is made
    anew; where it cannot be written, every load splits anew.
    """
    path = digits_cache()
    try:
        with np.load(path) as cached:
            parts = [cached[f"arr_{i}"] for i in range(len(DIGITS_SPLIT))]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        parts = []
    if [(a.dtype, a.shape) for a in parts] != DIGITS_SPLIT:
        parts = _split_digits()
        _keep(path, parts)
    x_tr, y_tr, x_te, y_te = parts
    return Dataset("digits", x_tr, y_tr, x_te, y_te, classes=10, pixel_max=16.0, shape=(1, 8, 8))


def _keep(path: str, arrays: list[np.ndarray]) -> None:
    """Write ``arrays`` to the npz file ``path`` as ``arr_0``, ``arr_1``, ... atomically
    (:func:`mpidl.checkpoint.replace_atomically`); nothing where the folder cannot be written."""
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        checkpoint.replace_atomically(path, lambda f: np.savez(f, *arrays))


def _split_digits() -> list[np.ndarray]:
    """scikit-learn's digits, split: x_train, y_train, x_test, y_test."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise DatasetError("the digits dataset needs scikit-learn: pip install 'mpidl[train]'") from exc
    x, y = sk_load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x.astype(np.uint8), y.astype(np.int64), test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y
    )
    return [x_tr, y_tr, x_te, y_te]


def digits_cache() -> str:
    """Where :func:`load_digits` keeps the digits' split: ``digits-split-SEED.npz`` in
    mpidl's cache directory (:func:`collectives.tuning.cache.directory`)."""
    return str(cache.directory() / f"digits-split-{SPLIT_SEED}.npz")


def user_dir(name: str) -> str:
    """Where ``mpidl data fetch`` puts dataset ``name`` by default:
    ``$XDG_DATA_HOME/mpidl/NAME`` (``~/.local/share/mpidl/NAME``)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "mpidl", name)


def default_dirs(name: str) -> list[str]:
    """Where :func:`load_idx` looks for IDX dataset ``name`` without a ``data_dir``, in order:
    its package's folder (if it has one), then :func:`user_dir`."""
    source = IDX_DATASETS[name]
    return [*([source.package_dir] if source.package_dir else []), user_dir(name)]


def how_to_get(name: str, data_dir: str | None = None) -> str:
    """The ways to get IDX dataset ``name``'s files, for an error message."""
    source = IDX_DATASETS[name]
    fetch = f"mpidl data fetch --dataset {name}" + (f" --data-dir {data_dir}" if data_dir else "")
    ways = [
        f"'{fetch}' downloads them and checks their SHA-256 (into {data_dir or user_dir(name)})",
        f"--data-dir DIR reads them from a folder of yours (torchvision's {source.torchvision}(ROOT, "
        f"download=True) puts them in ROOT/{source.torchvision}/raw)",
    ]
    if source.package:
        ways.insert(0, f"Debian's package {source.package} installs them in {source.package_dir}")
    count = {2: "two", 3: "three"}[len(ways)]
    return f"get {source.title}'s four IDX files one of {count} ways: " + "; ".join(ways)


def load_idx(name: str, data_dir: str | None = None) -> Dataset:
    """IDX dataset ``name`` (of :data:`IDX_DATASETS`) from its files in ``data_dir``, or else in
    the first of :func:`default_dirs` that holds any of them.

    Raises:
        DatasetError: files not found (saying how to get them: :func:`how_to_get`), a file
            unreadable, truncated or corrupt, images that are not 2-D or differ in shape
            between the splits, labels that are not integers in 0..9, or counts of images
            and labels that differ (naming the file).
    """
    if data_dir:
        folders = [data_dir]
    else:
        folders = default_dirs(name)
        folders = [f for f in folders if any(_present(f, stem) for stem in IDX_STEMS)][:1] or folders
    splits = []
    for split in ("train", "t10k"):
        images = _find(name, folders, data_dir, f"{split}-images-idx3-ubyte")
        labels = _find(name, folders, data_dir, f"{split}-labels-idx1-ubyte")
        x, y = read_idx(images), read_idx(labels)
        if x.ndim != 3:
            raise DatasetError(f"{images}: images of shape {x.shape}, not (count, rows, columns)")
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise DatasetError(f"{labels}: labels of shape {y.shape} and type {y.dtype}, not a vector of integers")
        if len(x) != len(y):
            raise DatasetError(f"{images} holds {len(x)} images, {labels} {len(y)} labels")
        bad = np.flatnonzero((y < 0) | (y >= IDX_CLASSES))
        if bad.size:
            raise DatasetError(
                f"{labels}: {bad.size} label(s) outside the classes 0..{IDX_CLASSES - 1} "
                f"(first: {y[bad[0]]} at index {bad[0]})"
            )
        splits.append((x, y))
    (x_tr, y_tr), (x_te, y_te) = splits
    if x_te.shape[1:] != x_tr.shape[1:]:
        title = IDX_DATASETS[name].title
        raise DatasetError(f"{title} in {folders[0]}: test images {x_te.shape[1:]}, training images {x_tr.shape[1:]}")
    return Dataset(
        name,
        x_tr.reshape(len(x_tr), -1),
        y_tr.astype(np.int64),
        x_te.reshape(len(x_te), -1),
        y_te.astype(np.int64),
        classes=IDX_CLASSES,
        pixel_max=255.0,
        shape=(1, int(x_tr.shape[1]), int(x_tr.shape[2])),
    )


def load_fashion_mnist(data_dir: str | None = None) -> Dataset:
    """Fashion-MNIST: :func:`load_idx` of ``"fashion-mnist"``."""
    return load_idx("fashion-mnist", data_dir)


#: Loaders by name; each takes the data directory (None: its default).
DATASETS: dict[str, Callable[[str | None], Dataset]] = {
    "digits": lambda data_dir: load_digits(),
    "fashion-mnist": load_fashion_mnist,
    "mnist": lambda data_dir: load_idx("mnist", data_dir),
}

# IDX type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT"); data is big-endian.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (gzipped when its name ends in ``.gz``) into an array of its shape.

    Raises:
        DatasetError: the file unreadable, a truncated or corrupt gzip stream, a bad
            magic number, or a size that does not match the header (naming the file).
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            blob = f.read()
    except EOFError:
        raise DatasetError(f"{path}: truncated (the gzip stream ends before its end marker)") from None
    except (gzip.BadGzipFile, zlib.error) as exc:
        raise DatasetError(f"{path}: corrupt gzip file ({exc})") from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot be read ({exc.strerror})") from None
    if len(blob) < 4 or blob[0] != 0 or blob[1] != 0 or blob[2] not in _IDX_DTYPES:
        raise DatasetError(f"{path}: not an IDX file (bad magic number)")
    dtype, ndim = np.dtype(_IDX_DTYPES[blob[2]]), blob[3]
    header = 4 + 4 * ndim
    if len(blob) < header:
        raise DatasetError(f"{path}: truncated ({len(blob)} bytes, the IDX header of {ndim} dimensions {header})")
    shape = tuple(int(d) for d in np.frombuffer(blob, ">u4", ndim, offset=4))
    size = header + math.prod(shape) * dtype.itemsize
    if len(blob) != size:
        raise DatasetError(
            f"{path}: {'truncated' if len(blob) < size else 'too long'} ({len(blob)} bytes; "
            f"the IDX header says {size}: shape {shape} of {dtype})"
        )
    return np.frombuffer(blob, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _present(folder: str, stem: str) -> str | None:
    """The path of ``stem.gz`` or ``stem`` in ``folder``, if either is a file."""
    for name in (stem + ".gz", stem):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def _find(name: str, folders: list[str], data_dir: str | None, stem: str) -> str:
    """The path of ``stem`` or ``stem.gz`` in the first of ``folders`` that has it."""
    for folder in folders:
        path = _present(folder, stem)
        if path:
            return path
    raise DatasetError(f"{stem}[.gz] not found in {' or '.join(folders)}; {how_to_get(name, data_dir)}")


def load(name: str, data_dir: str | None = None, comm: MPI.Comm | None = None) -> Dataset:
    """Load dataset ``name`` on rank 0 of ``comm`` and give every rank a normalized copy (collective).

    Raises:
        DatasetError: on every rank, if rank 0 could not load it (whatever it raised).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    raw, error, failure = None, None, None
    if comm.Get_rank() == 0:
        try:
            loader = DATASETS.get(name)
            if loader is None:
                raise DatasetError(f"unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")
            raw = loader(data_dir)
        except Exception as exc:  # shared below: a rank 0 that raised here would leave the others waiting
            failure = exc
            error = str(exc) if isinstance(exc, DatasetError) else f"cannot load {name!r}: {type(exc).__name__}: {exc}"
    raw, error = comm.bcast((raw, error), root=0)
    if isinstance(failure, DatasetError):
        raise failure
    if error is not None:
        raise DatasetError(error) from failure
    return raw.normalized()


def shard(n: int, rank: int, size: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The training-sample indices of worker ``rank`` of ``size`` (module docstring;
    ``shuffle=False``: consecutive blocks of the samples in order)."""
    return shards(n, size, seed, shuffle)[rank]


def shards(n: int, size: int, seed: int, shuffle: bool = True) -> list[np.ndarray]:
    """Every worker's :func:`shard`, drawn once (what one process simulating all
    ``size`` workers needs)."""
    if n < size:
        raise DatasetError(f"{n} training samples cannot be shared among {size} workers")
    perm = np.random.default_rng([seed, _SHARD_STREAM]).permutation(n) if shuffle else np.arange(n)
    return np.array_split(perm, size)


def steps_per_epoch(n: int, size: int, batch_size: int) -> int:
    """Steps every worker takes per epoch: ceil(largest shard / batch size).

    Raises:
        DatasetError: a bad batch size, or one so small that the smallest
            shard cannot fill every step (batch size 1 with uneven shards).
    """
    if batch_size < 1:
        raise DatasetError(f"batch size must be at least 1, got {batch_size}")
    steps = math.ceil(math.ceil(n / size) / batch_size)
    if n // size < steps:
        raise DatasetError(
            f"{n} samples on {size} workers: shards of {n // size} and {n // size + 1} samples "
            f"cannot all make {steps} batches; use a batch size of at least 2"
        )
    return steps


def epoch_order(indices: np.ndarray, seed: int, epoch: int, rank: int, sweep: int = 0) -> np.ndarray:
    """Worker ``rank``'s shard ``indices`` in ``epoch``'s order: shuffled by (seed, epoch,
    rank), and for ``sweep`` > 0, a further pass in the same epoch, by (seed, epoch,
    rank, sweep)."""
    key = [seed, _EPOCH_STREAM, epoch, rank] + ([sweep] if sweep else [])
    return indices[np.random.default_rng(key).permutation(len(indices))]


def epoch_batches(
    indices: np.ndarray, steps: int, seed: int, epoch: int, rank: int, sweep: int = 0
) -> list[np.ndarray]:
    """Worker ``rank``'s batches in ``epoch``: its shard ``indices`` in the epoch's order
    (:func:`epoch_order`) cut into ``steps`` consecutive batches of nearly equal size."""
    return np.array_split(epoch_order(indices, seed, epoch, rank, sweep), steps)


def batch_stream(indices: np.ndarray, steps: int, seed: int, epoch: int, rank: int) -> Iterator[np.ndarray]:
    """Worker ``rank``'s batches in ``epoch`` when it may take any number of steps
    (asynchronous training): :func:`epoch_batches`, then further sweeps over its
    shard, each shuffled anew, for as long as it asks."""
    for sweep in itertools.count():
        yield from epoch_batches(indices, steps, seed, epoch, rank, sweep)


class ShardSampler:
    """This worker's shard of a dataset of N samples, one epoch at a time, as indices
    for ``DataLoader(dataset, batch_size, sampler=...)`` (module docstring).

    Construction is collective over ``comm`` (default ``MPI.COMM_WORLD``): every
    worker must give the same N, ``seed``, ``shuffle`` and ``drop_last``. The
    shards are those of :func:`shard` (``shuffle=False``: consecutive blocks);
    each pass over the sampler (a ``DataLoader`` makes one per epoch) goes
    through the shard in :func:`epoch_order`'s order for the next epoch (the
    first pass: epoch 0), or for the epoch that :meth:`set_epoch` named
    (``shuffle=False``: in order). Iterating needs no communication and no torch.

    Args:
        dataset: the dataset (anything with a length) or its length N.
        comm: the workers' communicator.
        seed: seeds the shards and every epoch's order.
        shuffle: permute the samples before cutting the shards, and each
            epoch's order.
        drop_last: yield floor(N / n) indices rather than ceil(N / n) (module
            docstring).

    Attributes:
        indices: this worker's shard (sorted when not shuffled).
        epoch: the epoch of the next pass.

    Raises:
        DatasetError: on every rank, when the workers disagree or N < n.
    """

    def __init__(
        self,
        dataset: Sized | int,
        comm: MPI.Comm | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        n = len(dataset) if isinstance(dataset, Sized) else operator.index(dataset)
        self.rank, size = comm.Get_rank(), comm.Get_size()
        self.seed, self.shuffle, self.drop_last = seed, bool(shuffle), bool(drop_last)
        calls = comm.allgather((n, seed, self.shuffle, self.drop_last))
        if len(set(calls)) != 1:
            raise DatasetError(
                "ShardSampler: the workers give different (samples, seed, shuffle, drop_last): "
                + ", ".join(f"rank {r} {c}" for r, c in enumerate(calls))
            )
        self.indices = shard(n, self.rank, size, seed, self.shuffle)
        self.num_samples = n // size if self.drop_last else -(-n // size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass yield ``epoch``'s order (as ``DistributedSampler.set_epoch``;
        without it, every pass is the epoch after the last)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        order = epoch_order(self.indices, self.seed, epoch, self.rank) if self.shuffle else self.indices
        if len(order) < self.num_samples:
            order = np.concatenate((order, order[: self.num_samples - len(order)]))
        return iter(order[: self.num_samples].tolist())
