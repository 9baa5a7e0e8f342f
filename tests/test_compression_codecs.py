"""Compressors on one process: the registry, bit packing, each codec against an independent
formula, unbiasedness by statistics, payload sizes, and no allocation per step."""

from __future__ import annotations

import math
import sys
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

from collectives import ArgumentError, compression
from collectives.compression import COMPRESSORS, create
from collectives.compression.bits import pack_bits, packed_nbytes, unpack_bits
from collectives.compression.timing import mlp_shapes, time_codec
from collectives.transport import ops

DTYPES = ("float32", "float64", "float16", "bfloat16")
#: A spec with its options for every registered compressor (powersgd gets a layout per length).
SPECS = {
    "none": "none",
    "fp16": "fp16",
    "bf16": "bf16",
    "qsgd": "qsgd:127",
    "sign": "sign",
    "topk": "topk:0.1",
    "randk": "randk:0.1",
    "powersgd": "powersgd:2",
}


def build(name: str, length: int, **options) -> compression.Compressor:
    if name == "powersgd":
        options["shapes"] = mlp_shapes(length, width=8 if length < 5000 else 64)
    return create(SPECS[name], **options)


def buffer(values: np.ndarray, dtype: str):
    """``values`` as a buffer of ``dtype`` (bfloat16: a torch tensor)."""
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
    return values.astype(dtype)


def host(buf) -> np.ndarray:
    return buf.astype(np.float64) if isinstance(buf, np.ndarray) else buf.float().numpy().astype(np.float64)


def test_registry_names_every_compressor_and_specs_round_trip() -> None:
    assert set(SPECS) == set(COMPRESSORS)
    for name, spec in SPECS.items():
        c = build(name, 100)
        assert c.name == name and c.spec == spec
        assert create(c.spec, **({"shapes": mlp_shapes(100, 8)} if name == "powersgd" else {})).spec == c.spec
        assert c.aggregation == type(c).aggregations[0]
    assert create("QSGD").spec == "qsgd:127" and create(" topk : 0.5").spec == "topk:0.5"
    # The aggregation in the spec, kept there where it is not the default:
    assert create("sign@allgather").aggregation == "allgather" and create("sign@allgather").spec == "sign@allgather"
    assert create(" QSGD:31 @ AllGather").spec == "qsgd:31@allgather" and create("sign@reduce_scatter").spec == "sign"
    assert create("fp16", aggregation="allgather").spec == "fp16@allgather"
    assert [n for n, cls in COMPRESSORS.items() if cls.unbiased] == ["none", "qsgd", "randk"]
    assert [n for n, cls in COMPRESSORS.items() if cls.feedback] == ["topk", "powersgd"]


@pytest.mark.parametrize(
    "spec, options, words",
    [
        ("gzip", {}, "unknown compressor 'gzip'; valid compressors: none, fp16"),
        ("topk:0", {}, "ratio must be in (0, 1]"),
        ("topk:1.5", {}, "ratio must be in (0, 1]"),
        ("randk:-0.1", {}, "ratio must be in (0, 1]"),
        ("topk:nan", {}, "ratio must be in (0, 1]"),
        ("topk:abc", {}, "the ratio must be float, got 'abc'"),
        ("qsgd:0", {}, "levels must be 1 to 127"),
        ("qsgd:128", {}, "levels must be 1 to 127"),
        ("qsgd:1.5", {}, "the levels must be int"),
        ("qsgd", {"bucket": 0}, "bucket must be at least 1"),
        ("sign:0", {}, "bucket must be at least 1"),
        ("sign:x", {}, "sign:x: the bucket must be a number of elements or 'layer', got 'x'"),
        ("sign:8", {"shapes": [(0, (4,)), (2, (4,))]}, "sign: layout entry 1 starts at 2"),
        ("topk:0.1", {"shapes": [(0, (4, -1))]}, "topk: layout entry 0 has a negative dimension"),
        ("none:1", {}, "'none' takes no parameter"),
        ("powersgd:0", {"shapes": [(0, (4, 4))]}, "rank must be at least 1"),
        ("powersgd:4", {}, "powersgd needs the layers' layout"),
        ("powersgd:1", {"shapes": [(0, (4, 4)), (8, (4,))]}, "entry 1 starts at 8, but the layers before it end at 16"),
        ("powersgd:1", {"shapes": [(4, (4, 4))]}, "entry 0 starts at 4"),
        ("powersgd:1", {"shapes": [(0, (4, -4))]}, "negative dimension"),
        ("powersgd:1", {"shapes": [(0, 4)]}, "entry 0 must be (offset, shape)"),
        ("topk:0.1", {"aggregation": "reduce_scatter"}, "aggregates by allgather, not 'reduce_scatter'"),
        ("topk:0.1@reduce_scatter", {}, "aggregates by allgather, not 'reduce_scatter'"),
        ("sign@ring", {}, "aggregates by reduce_scatter, allgather or hierarchical, not 'ring'"),
        ("sign@allgather", {"aggregation": "reduce_scatter"}, "aggregation='reduce_scatter' disagrees"),
        ("fp16", {"aggregation": "allreduce"}, "aggregates by reduce_scatter, allgather or hierarchical"),
        ("fp16", {"bucket": 4}, "unexpected keyword argument 'bucket'"),
    ],
)
def test_bad_specs_raise_clearly(spec: str, options: dict, words: str) -> None:
    with pytest.raises(ArgumentError) as error:
        create(spec, **options)
    assert words in str(error.value)


def test_bad_buffers_raise_clearly() -> None:
    c = create("sign")
    with pytest.raises(ArgumentError, match="floating-point buffer, got int32"):
        c.compress(np.zeros(4, np.int32))
    with pytest.raises(ArgumentError, match="a payload for 5 float32 elements has 8 bytes, got 16"):
        c.decompress(np.zeros(16, np.uint8), np.zeros(5, np.float32))
    p = create("powersgd:1", shapes=[(0, (4, 4))])
    with pytest.raises(ArgumentError, match="the layout covers 16 elements, not 15"):
        p.compress(np.zeros(15, np.float32))
    r = create("randk:0.5")
    with pytest.raises(ArgumentError, match="draw, which was not made yet"):
        r.decompress(np.zeros(8, np.uint8), np.zeros(4, np.float32))
    r.compress(np.zeros(6, np.float32))
    with pytest.raises(ArgumentError, match="for 6 elements, not 4"):
        r.decompress(np.zeros(8, np.uint8), np.zeros(4, np.float32))


@pytest.mark.parametrize("dtype", ["bool", "uint8"])
def test_bits_round_trip_every_length(dtype: str) -> None:
    rng = np.random.default_rng(1)
    for n in range(301):
        flags = (rng.random(n + 3) < 0.5).astype(dtype)[3:]  # unaligned start
        packed = np.full(packed_nbytes(n) + 1, 0xAA, np.uint8)
        pack_bits(flags, packed[:-1])
        assert packed[:-1].tobytes() == np.packbits(flags, bitorder="little").tobytes(), n
        assert packed[-1] == 0xAA  # nothing written past the end
        for values, out_dtype in (((0, 1), np.uint8), ((-1, 1), np.float32), ((-2.5, 7.0), np.float64)):
            out = np.zeros(n, out_dtype)
            unpack_bits(packed, out, values)
            assert np.array_equal(out, np.where(flags.astype(bool), values[1], values[0])), (n, values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_is_the_bucket_mean_magnitude_times_the_sign(dtype: str) -> None:
    c = create("sign", bucket=24)
    for n in [*range(0, 70), 300]:
        x = host(buffer(np.random.default_rng(n).standard_normal(n), dtype))
        x[::5] = 0.0  # sign(0) = +1
        work = x.astype(np.float64 if dtype == "float64" else np.float32)
        out = buffer(np.zeros(n), dtype)
        c.decompress(c.compress(buffer(x, dtype)), out)
        expected = np.concatenate(
            [np.where(v >= 0, 1, -1) * np.mean(np.abs(v)) for v in np.split(work, range(24, n, 24))] if n else [[]]
        )
        assert np.array_equal(host(out), host(buffer(expected.astype(work.dtype), dtype))), n


#: A layout of 4 + 0 + 30 + 7 elements: the scales and selections of layers restart at 4, 34.
LAYERS = [(0, (4,)), (4, (0,)), (4, (5, 6)), (34, (7,))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_per_layer_is_each_layers_l1_norm_over_its_size(dtype: str) -> None:
    """sign:layer, EF-signSGD's scaled sign: every layer's scale is ||v||_1 / d of that
    layer; sign:8 with a layout: buckets of 8 that restart at every layer."""
    x = host(buffer(np.random.default_rng(3).standard_normal(41) * np.repeat([1.0, 1.0, 10.0], [4, 30, 7]), dtype))
    work = x.astype(np.float64 if dtype == "float64" else np.float32)
    for spec, bounds in [("sign:layer", [4, 34]), ("sign:8", [4, 12, 20, 28, 34])]:
        c = create(spec, shapes=LAYERS)
        scales = (len(bounds) + 1) * work.itemsize
        assert c.spec == spec and c.payload_nbytes(41, dtype) == 8 * -(-(scales + 6) // 8)  # 41 bits: 6 bytes
        out = buffer(np.zeros(41), dtype)
        c.decompress(c.compress(buffer(x, dtype)), out)
        expected = np.concatenate([np.where(v >= 0, 1, -1) * np.mean(np.abs(v)) for v in np.split(work, bounds)])
        assert np.array_equal(host(out), host(buffer(expected.astype(work.dtype), dtype))), spec
    assert create("sign:layer").payload_nbytes(41) == 8 + 8  # no layout: one scale for the buffer


def test_topk_per_layer_keeps_each_layers_largest() -> None:
    """With a layout, top-k keeps round(ratio d_l) (at least 1) of every layer l, and
    ``selected`` lists them in order."""
    x = np.random.default_rng(4).standard_normal(41) * np.repeat([1.0, 1.0, 10.0], [4, 30, 7])
    c = create("topk:0.2", shapes=LAYERS)
    out = np.zeros(41)
    c.decompress(c.compress(x), out)
    keep = [a + np.sort(np.argsort(-np.abs(x[a:b]))[:k]) for a, b, k in [(0, 4, 1), (4, 34, 6), (34, 41, 1)]]
    assert np.array_equal(c.selected, np.concatenate(keep)) and c.k(41) == 8
    assert np.array_equal(np.flatnonzero(out), c.selected) and np.allclose(out[c.selected], x[c.selected], rtol=1e-3)
    with pytest.raises(ArgumentError, match="the layout covers 41 elements, the buffer has 40"):
        c.compress(x[:40])


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_keeps_the_largest_magnitudes(dtype: str) -> None:
    """The k largest magnitudes, ties to the lower index, each rounded to 11 significant
    bits under the power of two above the largest; across blocks of 65,536 elements."""
    c = create("topk:0.2")
    for n in [0, 1, 2, 5, 17, 100, 1001, 70_000, 200_001]:
        rng = np.random.default_rng(n)
        x = host(buffer(rng.standard_normal(n).round(1) * 10.0 ** rng.integers(-3, 3, n), dtype))  # many ties
        k = c.k(n)
        out = buffer(np.full(n, 9.0), dtype)
        c.decompress(c.compress(buffer(x, dtype)), out)
        keep = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])  # ties: the lower index first
        expected = np.zeros(n)
        if n:
            e = np.frexp(np.abs(x[keep]).max())[1]
            expected[keep] = np.ldexp(np.ldexp(x[keep], -e).astype(np.float16).astype(np.float64), e)
        assert np.array_equal(host(out), host(buffer(expected, dtype))), n
        assert k == (0 if n == 0 else max(1, round(0.2 * n)))


def test_topk_is_exact_where_the_sampled_threshold_misses() -> None:
    """The threshold estimated from a sample only narrows the search: where fewer than k
    elements lie above it (the sample's elements are the largest), where most elements are
    zero, and with NaNs, the selection is still exactly the k largest, ties to the lower index."""
    n, c = 100_000, create("topk:0.01")
    rng = np.random.default_rng(5)
    missed = np.ones(n, np.float32)
    missed[c._sample_index(np, n)] = 2.0  # every sampled element is among the largest
    sparse = np.zeros(n, np.float32)
    sparse[rng.integers(0, n, 300)] = rng.standard_normal(300)
    nans = rng.standard_normal(n).astype(np.float32)
    nans[rng.integers(0, n, 50)] = np.nan
    for name, x in [("missed", missed), ("sparse", sparse), ("nans", nans)]:
        c.compress(x)
        magnitude = np.where(np.isnan(x), np.inf, np.abs(x))
        assert np.array_equal(c.selected, np.sort(np.argsort(-magnitude, kind="stable")[: c.k(n)])), name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_residual_is_the_vector_less_its_decoded_encoding(name: str) -> None:
    """What error feedback keeps, x - decode(encode(x)), bit for bit as the subtraction
    gives it, however a codec computes it (top-k: a copy and O(k) fixes), with zeros of
    both signs, NaNs and infinities among the kept elements."""
    n = 70_001
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    x[:5] = [-0.0, 0.0, np.nan, np.inf, -np.inf]
    x[5 : n // 2] = 0.0  # a vector with fewer nonzeros than most sparsifiers keep: zeros are kept
    x[-3:] = -0.0
    for c in (build(name, n), create(f"{name}:0.9") if name == "topk" else None):
        if c is None:
            continue
        payload = c.compress(x)
        decoded = np.empty_like(x)
        c.decompress(payload, decoded)
        residual = np.full_like(x, 7.0)
        c._residual(x, payload, residual)
        assert residual.tobytes() == np.subtract(x, decoded).tobytes(), c.spec


def test_topk_takes_nans_first() -> None:
    x = np.array([1.0, np.nan, -3.0, 2.0], np.float32)
    out = np.empty_like(x)
    create("topk:0.5").decompress(create("topk:0.5").compress(x), out)
    assert np.isnan(out[1]) and out[2] == -3.0 and out[0] == out[3] == 0


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_casts_round_to_nearest_even(name: str, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    x = buffer(np.random.default_rng(0).standard_normal(1000) * 1e3, dtype)
    out = buffer(np.zeros(1000), dtype)
    c = create(name)
    c.decompress(c.compress(x), out)
    half = torch.float16 if name == "fp16" else torch.bfloat16
    expected = torch.from_numpy(host(x)).to(half).double().numpy()  # float64 -> half rounds once
    assert np.array_equal(host(out), host(buffer(expected, dtype)))


def _without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import torch`` fail, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(ops, "_host_torch", lambda: None)


def _float32_edge_cases() -> np.ndarray:
    """Random float32 bits (NaNs with payloads, subnormals, infinities included), and
    the values where rounding to bfloat16 ties or carries into the exponent."""
    bits = np.random.default_rng(1).integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32)
    ties = np.array([0x3F808000, 0x3F818000, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x80018000], np.uint32)
    specials = np.array([0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0, 0x80000000], np.uint32)
    return np.concatenate([bits, ties, specials]).view(np.float32)


def test_bfloat16_casts_without_torch_are_torchs_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    x = _float32_edge_cases()
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    _without_torch(monkeypatch)
    narrowed = np.zeros(x.size, np.uint16)
    ops.narrow(x, narrowed, "bfloat16")
    nan = np.isnan(x)
    assert np.array_equal(narrowed[~nan], expected[~nan]) and nan.sum() > 50
    assert np.isnan((narrowed.astype(np.uint32) << 16).view(np.float32)[nan]).all()
    widened = np.zeros(x.size, np.float32)
    ops.widen(narrowed, widened, "bfloat16")
    back = torch.from_numpy(expected.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(widened.view(np.uint32), back.view(np.uint32))


def test_bf16_compresses_host_buffers_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    _without_torch(monkeypatch)
    # 1 + 2^-8 ties to 1 (even), 1 + 3 * 2^-8 to 1 + 2^-6, 2^128 overflows, NaN stays NaN
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -2.5, 3.4e38 * 1.0001, np.nan, 0.0], np.float32)
    c = create("bf16")
    out = np.zeros_like(x)
    c.decompress(c.compress(x), out)
    assert out[:3].tolist() == [1.0, 1 + 2**-6, -2.5] and np.isposinf(out[3]) and np.isnan(out[4]) and out[5] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_qsgd_sends_levels_of_the_bucket_unit(dtype: str) -> None:
    c = create("qsgd:3", bucket=10)
    for n in [0, 1, 9, 10, 11, 95]:
        x = host(buffer(np.random.default_rng(n).standard_normal(n), dtype))
        work = x.astype(np.float64 if dtype == "float64" else np.float32)
        out = np.zeros(n, work.dtype)
        payload = c.compress(buffer(x, dtype))
        c.decompress(payload, out)
        units = np.repeat([np.linalg.norm(work[i : i + 10]) / 3 for i in range(0, n, 10)], 10)[:n]
        levels = out / np.where(units > 0, units, 1)
        assert np.allclose(levels, np.round(levels), atol=1e-5) and np.all(np.abs(levels) <= 3 + 1e-5)
        assert np.all(np.abs(out - work) <= units * (1 + 1e-5))
        assert np.all(out * work >= 0)  # never the wrong sign


def test_identity_and_randk_and_powersgd_codecs() -> None:
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    out = np.empty_like(x)
    create("none").decompress(create("none").compress(x), out)
    assert np.array_equal(out, x)
    r = create("randk:0.05", seed=3)
    r.decompress(r.compress(x), out)
    assert np.count_nonzero(out) == 50 and np.array_equal(out[out != 0], x[out != 0] * np.float32(20))
    first = np.flatnonzero(out)
    r.decompress(r.compress(x), out)
    assert not np.array_equal(np.flatnonzero(out), first)  # a new draw per step
    again = create("randk:0.05", seed=3)
    again.decompress(again.compress(x), out)
    assert np.array_equal(np.flatnonzero(out), first)  # the same seed, the same draws


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_powersgd_compress_reproduces_a_rank_r_layout(dtype: str) -> None:
    rng = np.random.default_rng(5)
    shapes = [(0, (30, 40)), (1200, (40,)), (1240, (20, 2, 3, 5)), (1840, (3, 3))]
    x = rng.standard_normal(1849)
    x[:1200] = (rng.standard_normal((30, 3)) @ rng.standard_normal((3, 40))).ravel()
    x[1240:1840] = (rng.standard_normal((20, 3)) @ rng.standard_normal((3, 30))).ravel()
    x = x.astype(dtype)
    c = create("powersgd:3", shapes=shapes)
    assert c.layers == [(0, 30, 40), (1240, 20, 30)] and c.plain == [(1200, 1240), (1840, 1849)]
    payload = c.compress(x)
    assert payload.nbytes == (3 * (30 + 40 + 20 + 30) + 40 + 9) * np.dtype(dtype).itemsize
    out = np.empty_like(x)
    c.decompress(payload, out)
    assert np.allclose(out, x, rtol=0, atol=(1e-4 if dtype == "float32" else 1e-11) * np.abs(x).max())


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_payload_sizes(name: str, dtype: str) -> None:
    for n in [0, 1, 7, 64, 513, 1100]:
        c = build(name, n)
        payload = c.compress(buffer(np.linspace(-1, 1, n), dtype))
        assert payload.dtype == np.uint8 and payload.ndim == 1
        assert payload.nbytes == c.payload_nbytes(n, dtype), n
    assert create("qsgd:127").payload_nbytes(1024) == 1024 + 2 * 4
    assert create("sign").payload_nbytes(1024, "float64") == 128 + 2 * 8
    assert create("topk:0.01").payload_nbytes(1000) == 4 + 10 * 4 + 4  # scale, halves, low bits, a block
    assert create("topk:0.01").payload_nbytes(200_000, "float64") == 8 + 2000 * 4 + 4 * 4
    assert create("fp16").payload_nbytes(1001, "float64") == 2002


def _mean_and_bound(samples: np.ndarray, variance: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sample mean over the rows and 5 standard errors of it (from the exact variance)."""
    return samples.mean(axis=0), 5 * np.sqrt(variance / samples.shape[0])


def test_qsgd_is_unbiased() -> None:
    """The mean of 4000 quantisations lies within 5 standard errors (exact variance
    u^2 p (1 - p) per element) of the input, and elements with no variance are exact;
    rounding to the nearest level instead fails the same test."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(64) * np.repeat([1e-3, 1.0, 30.0, 1.0], 16)).astype(np.float64)
    x[5] = 0.0
    c, out = create("qsgd:3", bucket=16, seed=11), np.empty_like(x)
    samples = np.array([c.decompress(c.compress(x), out).copy() for _ in range(4000)])
    units = np.repeat([np.linalg.norm(x[i : i + 16]) / 3 for i in range(0, 64, 16)], 16)
    frac = np.abs(x) / units % 1
    mean, bound = _mean_and_bound(samples, units**2 * frac * (1 - frac))
    assert np.all(np.abs(mean - x) <= bound + 1e-12 * np.abs(x))
    spread = frac > 0.05
    z = (mean - x)[spread] / np.sqrt(units**2 * frac * (1 - frac) / 4000)[spread]
    assert abs(np.mean(z**2) - 1) < 0.5  # the spread is as predicted, not looser
    nearest = np.sign(x) * np.round(np.abs(x) / units) * units
    assert np.any(np.abs(nearest - x) > bound)


def test_randk_is_unbiased() -> None:
    """The mean of 4000 random-k vectors lies within 5 standard errors (exact variance
    (d/k - 1) x^2 per element) of the input."""
    x = np.random.default_rng(8).standard_normal(40)
    c, out = create("randk:0.25", seed=2), np.empty_like(x)
    samples = np.array([c.decompress(c.compress(x), out).copy() for _ in range(4000)])
    mean, bound = _mean_and_bound(samples, (40 / 10 - 1) * x**2)
    assert np.all(np.abs(mean - x) <= bound)
    assert np.all(np.count_nonzero(samples, axis=1) == 10)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_no_allocation_per_step(name: str) -> None:
    """After a first step, compress, decompress and a (one-rank) allreduce with a residual
    allocate nothing of the buffer's size: below 256 KiB (numpy's casting buffers) for
    400 000 elements, plus O(k) index arrays for the sparsifiers (random-k at a ratio of
    1/100: numpy draws k of d by Floyd's algorithm below 1/50, by a permutation above;
    top-k: the positions of its some 1.5 k candidates above the sampled threshold)."""
    n = 400_000
    c = build(name, n) if name != "randk" else create("randk:0.01")
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out, residual = np.empty_like(x), np.empty_like(x)

    def step() -> None:
        c.decompress(c.compress(x), out)
        c.allreduce(out, MPI.COMM_SELF, residual=residual, validate=False)

    step()
    tracemalloc.start()
    step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < (256 << 10) + 48 * getattr(c, "k", lambda n: 0)(n), peak


def test_timing_helper() -> None:
    t = time_codec(create("sign"), 4096, repeat=2)
    assert t.compress_s > 0 and t.decompress_s > 0 and t.payload_nbytes == 512 + 8 * 4
    layout = mlp_shapes(2 * 64 * 64 + 2 * 64 + 300, width=64)
    assert [s for _, s in layout] == [(64, 64), (64,), (64, 64), (64,), (4, 64), (44,)]
    assert sum(math.prod(s) for _, s in layout) == 2 * 64 * 64 + 2 * 64 + 300
