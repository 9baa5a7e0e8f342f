"""How long compressors take to encode and decode on this machine (no communication).

:func:`time_codec` times ``compress`` and ``decompress`` of one buffer, the
median of several repetitions after a warm-up (which also allocates the
reusable memory, so the timed steps allocate nothing of the buffer's size);
:func:`mlp_shapes` gives PowerSGD a plausible layout for a buffer of a given
length. As a script it prints a table for every compressor::

    python -m collectives.compression.timing [--size 16.6MiB] [--repeat 5] [--zeros 0.6]

(``--zeros``: that fraction of the elements zero, at random places, as in
the gradient of a layer after a ReLU.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from . import COMPRESSORS, Compressor, create
from .base import Shapes

#: The compressors the script times, each with its usual parameter.
SPECS = ("none", "fp16", "bf16", "qsgd:127", "sign", "topk:0.01", "randk:0.01", "powersgd:4")


class CodecTiming(NamedTuple):
    """Median seconds of one ``compress`` and one ``decompress``, and the payload's bytes."""

    compress_s: float
    decompress_s: float
    payload_nbytes: int


def time_codec(
    compressor: Compressor, length: int, dtype: str = "float32", repeat: int = 5, zeros: float = 0.0
) -> CodecTiming:
    """Time ``compressor`` on a buffer of ``length`` normal values of ``dtype`` (numpy;
    bfloat16 as a torch tensor), a fraction ``zeros`` of them (at random) set to zero."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal(length, dtype=np.float32)
    if zeros:
        values[rng.random(length) < zeros] = 0
    buf: Any = values.astype(dtype) if dtype != "bfloat16" else None
    if buf is None:
        import torch

        buf = torch.from_numpy(values).to(torch.bfloat16)
    out = buf.clone() if dtype == "bfloat16" else np.empty_like(buf)
    compressed, decompressed = [], []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        payload = compressor.compress(buf)
        middle = time.perf_counter()
        compressor.decompress(payload, out)
        compressed.append(middle - start)
        decompressed.append(time.perf_counter() - middle)
    return CodecTiming(statistics.median(compressed[1:]), statistics.median(decompressed[1:]), int(payload.nbytes))


def mlp_shapes(length: int, width: int = 2048) -> Shapes:
    """A layout of ``length`` elements shaped like an MLP's: width x width weight
    matrices each followed by a bias of width, then a last matrix of fewer rows and
    a vector for what remains."""
    layout: list[tuple[int, tuple[int, ...]]] = []
    at = 0
    while length - at >= width * width + width:
        layout += [(at, (width, width)), (at + width * width, (width,))]
        at += width * width + width
    rows = (length - at) // width
    if rows:
        layout.append((at, (rows, width)))
        at += rows * width
    if at < length:
        layout.append((at, (length - at,)))
    return layout


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16.6MiB", help="buffer size: bytes, or with KiB/MiB/GiB (default 16.6MiB)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--specs", default=",".join(SPECS), help=f"compressors, of {', '.join(COMPRESSORS)}")
    parser.add_argument("--zeros", type=float, default=0.0, help="fraction of the elements set to zero (default 0)")
    args = parser.parse_args(argv)
    itemsize = 2 if args.dtype == "bfloat16" else np.dtype(args.dtype).itemsize
    length = _nbytes(args.size) // itemsize
    print(f"{length} {args.dtype} elements ({args.zeros:.0%} zero), median of {args.repeat}")
    print(f"{'compressor':<14}{'compress ms':>12}{'decompress ms':>15}{'payload':>12}{'of input':>10}")
    for spec in args.specs.split(","):
        options = {"shapes": mlp_shapes(length)} if spec.startswith("powersgd") else {}
        t = time_codec(create(spec, **options), length, args.dtype, args.repeat, args.zeros)
        whole = length * itemsize
        print(
            f"{spec:<14}{t.compress_s * 1e3:>12.1f}{t.decompress_s * 1e3:>15.1f}"
            f"{t.payload_nbytes:>12}{t.payload_nbytes / whole:>10.4f}"
        )
    return 0


def _nbytes(text: str) -> int:
    """Bytes from "16.6MiB", "4KiB", "1048576"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
