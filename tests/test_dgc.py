"""Deep Gradient Compression's techniques around top-k in AllReduce-SGD on 1..4 ranks
(algorithms/dgc.py): local clipping scales each worker's gradient, momentum factor
masking zeroes the velocity of the elements sent, the sparsity warm-up's density per
stage; bad options raise on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpitest import all_ok, comm_of_size

import algorithms
from algorithms import SGD
from algorithms.dgc import DGC
from collectives import ArgumentError
from collectives.compression.topk import kept

pytestmark = pytest.mark.mpi


def gradient(x: np.ndarray, rank: int, t: int) -> np.ndarray:
    """Worker ``rank``'s gradient at step t: different on every rank and step, norm ~5."""
    return x - np.sin(np.arange(x.size).reshape(x.shape) * (rank + 1) + t)


def test_warmup_density_per_stage() -> None:
    """25 %, 6.25 %, 1.5625 % (K steps each), then the target; no warm-up: the target."""
    dgc = DGC(None, False, 3, 0.01)
    assert [dgc.ratio(t) for t in range(13)] == [0.25] * 3 + [0.0625] * 3 + [0.015625] * 3 + [0.01] * 4
    assert DGC(None, False, 2, 0.1).ratio(2) == 0.1 and DGC(None, False, 0, 0.01).ratio(0) == 0.01


def test_clip_scales_each_tensor_over_the_norm_to_it() -> None:
    g = np.concatenate([np.full(4, 3.0), np.full(9, 0.1), np.full(4, -2.0)])
    before = g.copy()
    DGC(1.5, False, 0, 1.0).clip(g, [(0, 4), (4, 13), (13, 17)])
    assert np.allclose(g[:4], 0.75, rtol=1e-15) and np.allclose(g[13:], -0.75, rtol=1e-15)
    assert np.array_equal(g[4:13], before[4:13])  # norm 0.3: untouched
    DGC(None, False, 0, 1.0).clip(g, [(0, 17)])  # no clip norm: nothing
    assert np.allclose(g[:4], 0.75, rtol=1e-15)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_clipped_step_is_the_mean_of_the_clipped_gradients(size: int) -> None:
    """randk:1 drops nothing: the step is -lr times the mean of every worker's gradient
    scaled to the clip norm (norms ~5 > 1)."""
    comm = comm_of_size(size)
    n, ok = comm.Get_size(), True
    x = np.zeros((6, 8))
    with algorithms.AllReduceSGD(x, SGD(x, lr=0.1), comm, compression="randk:1", clip_norm=1.0) as algo:
        algo.step(gradient(x, comm.Get_rank(), 0))
    grads = [gradient(np.zeros((6, 8)), r, 0) for r in range(n)]
    ok &= bool(np.allclose(x, -0.1 * np.mean([g / np.linalg.norm(g) for g in grads], axis=0), rtol=1e-12, atol=0))
    assert all_ok(comm, ok), size


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_masking_zeroes_the_velocity_of_the_elements_sent(size: int) -> None:
    """First step, momentum 0.9: the velocity is the gradient but at the 12 (25 % of 48)
    elements of largest magnitude, which top-k sent, where it is 0, also by default
    (None); without masking it is the gradient everywhere."""
    comm = comm_of_size(size)
    ok = True
    for masking in (True, None, False):
        x = np.zeros((6, 8))
        opt = SGD(x, lr=0.1, momentum=0.9)
        with algorithms.AllReduceSGD(x, opt, comm, compression="topk:0.25", momentum_masking=masking) as algo:
            g = gradient(x, comm.Get_rank(), 0)
            algo.step(g.copy())
            assert algo.local_momentum is not None
            velocity = algo.local_momentum.velocity
        sent = np.sort(np.argsort(-np.abs(g.ravel()), kind="stable")[:12])
        expected = g.ravel().copy()
        if masking is not False:
            expected[sent] = 0
        ok &= np.array_equal(velocity, expected)
    assert all_ok(comm, ok), size


@pytest.mark.parametrize(
    "compression, momentum, local",
    [("topk:0.25", 0.0, None), ("topk:0.25", 0.9, False), ("sign", 0.9, None), ("randk:0.25", 0.9, True)],
)
def test_masking_is_on_by_default_only_for_topk_with_local_momentum(
    compression: str, momentum: float, local: bool | None
) -> None:
    """Where top-k has no local momentum to mask (SGD without momentum, or local momentum
    off), or the compressor is not top-k, the default leaves DGC off and raises nothing."""
    x = np.zeros(48)
    opt = SGD(x, lr=0.1, momentum=momentum)
    with algorithms.AllReduceSGD(x, opt, MPI.COMM_WORLD, compression=compression, local_momentum=local) as algo:
        assert algo.dgc is None


@pytest.mark.parametrize("overlap", [False, True])
def test_masking_finds_the_elements_of_every_bucket(overlap: bool) -> None:
    """Torch, a bucket per parameter or two: after a step the velocity with masking is the
    velocity without it but 0 at every bucket's start plus the indices top-k sent."""
    torch = pytest.importorskip("torch")
    from test_overlap import SMALL_BUCKETS, batches, loss, mlp

    comm, velocity, sent = comm_of_size(2), {}, []
    for masking in (True, False):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        options = {"compression": "topk:0.1", "momentum_masking": masking, "bucket_mb": SMALL_BUCKETS}
        with algorithms.AllReduceSGD(model, opt, comm, overlap=overlap, **options) as algo:
            x, y = batches(comm, 1)[0]
            algo.zero_grad()
            loss(model, x, y).backward()
            algo.step()
            assert algo.local_momentum is not None and algo.compression is not None
            velocity[masking] = algo.local_momentum.velocity.clone()
            if masking:
                sent = [
                    b.start + np.asarray(f.compressor.selected) for b, f in zip(algo.buckets, algo.compression.feedback)
                ]
    masked = velocity[False].clone()
    masked[torch.as_tensor(np.concatenate(sent))] = 0
    ok = len(sent) > 2 and torch.equal(velocity[True], masked) and bool(velocity[False][np.concatenate(sent)].all())
    assert all_ok(comm, ok)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_warmup_keeps_the_stages_fraction_each_step(size: int) -> None:
    """sparsity_warmup=2 on 4096 elements: top-k keeps 1024, 1024, 256, 256, 64, 64, then
    41 (1 %) elements a step; one model on every rank."""
    comm = comm_of_size(size)
    counts, ok = [], True
    x = np.zeros(4096, np.float32)
    with algorithms.AllReduceSGD(x, SGD(x, lr=0.01), comm, compression="topk:0.01", sparsity_warmup=2) as algo:
        assert algo.compression is not None
        for t in range(8):
            algo.step(gradient(x, comm.Get_rank(), t).astype(np.float32))
            counts.append(algo.compression.feedback[0].compressor.selected.shape[0])
    ok &= counts == [1024, 1024, 256, 256, 64, 64, 41, 41] and kept(0.01, 4096) == 41
    ok &= np.array_equal(comm.bcast(x), x)
    assert all_ok(comm, ok), counts


@pytest.mark.parametrize(
    "options, match",
    [
        ({"clip_norm": 1.0}, "clip_norm clips each worker's gradient before compression: it needs a compression"),
        ({"compression": "topk:0.1", "clip_norm": 0.0}, "clip_norm must be a positive number, got 0.0"),
        ({"compression": "topk:0.1", "clip_norm": float("nan")}, "clip_norm must be a positive number"),
        ({"compression": "topk:0.1", "clip_norm": True}, "clip_norm must be a positive number, got True"),
        ({"compression": "sign", "sparsity_warmup": 3}, "sparsity_warmup warms top-k's sparsity up"),
        ({"compression": "topk:0.1", "sparsity_warmup": -1}, "sparsity_warmup must be a number of steps >= 0"),
        ({"compression": "topk:0.1", "sparsity_warmup": 1.5}, "sparsity_warmup must be a number of steps >= 0"),
        ({"compression": "sign", "momentum_masking": True}, "momentum_masking zeroes the local momentum"),
        ({"compression": "topk:0.1", "momentum_masking": True}, "it needs compression topk:RATIO and local momentum"),
        ({"compression": "topk:0.1", "momentum_masking": "yes"}, "momentum_masking must be None, True or False"),
    ],
)
def test_bad_dgc_options_raise_on_every_rank(options: dict, match: str) -> None:
    """(The masking case without local momentum: SGD without momentum has none.)"""
    comm = MPI.COMM_WORLD
    x = np.zeros(8)
    with pytest.raises(ArgumentError, match=match) as info:
        algorithms.AllReduceSGD(x, SGD(x, lr=0.1), comm, **options)
    assert all_ok(comm, len(set(comm.allgather(str(info.value)))) == 1)
