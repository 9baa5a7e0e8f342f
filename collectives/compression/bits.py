"""Bits packed eight to a byte, and back, without allocating.

Bit k of byte j holds element 8 j + k (numpy's ``bitorder="little"``); a
vector of n flags takes ceil(n/8) bytes, the unused high bits of the last byte
zero.

Packing reads each run of eight flags (bytes that are 0 or 1) as one
little-endian 64-bit word w = sum_k b_k 2^(8k) and multiplies it by
M = sum_k 2^(56-7k) = 0x0102040810204080: the product's top byte is
sum_k b_k 2^k, since every other term b_k 2^(56+8k-7j) (j != k) lands either
above bit 63 (discarded) or below bit 56, each at its own bit (8k - 7j takes
distinct values), so no carry reaches the top byte. One multiply and one
shift per eight flags, into reusable memory, on numpy or CuPy alike.
Unpacking looks each byte up in a 256 x 8 table of the two output values
(``take`` with ``out=``).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..transport.buffers import array_module
from ..transport.scratch import scratch
from .memory import CODEC, take

_MAGIC = np.uint64(0x0102040810204080)
_SHIFT = np.uint64(56)
_LITTLE = sys.byteorder == "little"
_WORDS, _TAIL = CODEC + 6, CODEC + 7  # scratch slots
_tables: dict[tuple[Any, np.dtype, tuple[float, float]], Any] = {}


def packed_nbytes(count: int) -> int:
    """Bytes that ``count`` packed bits take."""
    return -(-count // 8)


def pack_bits(flags: Any, out: Any) -> None:
    """Pack ``flags`` (uint8 or bool, each 0 or 1) into the uint8 array ``out`` of
    :func:`packed_nbytes` bytes."""
    n = flags.shape[0]
    if n == 0:
        return
    xp = array_module(flags)
    flags = flags.view(np.uint8)
    if not _LITTLE:  # the word trick reads bytes little-endian
        out[:] = xp.packbits(flags, bitorder="little")
        return
    whole = n // 8
    if whole:
        words = scratch(flags, whole, _WORDS, np.uint64)
        xp.multiply(flags[: 8 * whole].view(np.uint64), _MAGIC, out=words)
        xp.right_shift(words, _SHIFT, out=words)
        xp.copyto(out[:whole], words, casting="unsafe")
    if n > 8 * whole:
        tail = scratch(flags, 8, _TAIL, np.uint8)
        tail.fill(0)
        tail[: n - 8 * whole] = flags[8 * whole :]
        word = tail.view(np.uint64)
        xp.multiply(word, _MAGIC, out=word)
        xp.right_shift(word, _SHIFT, out=word)
        out[whole] = word[0]


def unpack_bits(packed: Any, out: Any, values: tuple[float, float] = (0, 1)) -> None:
    """Set ``out`` (any numeric dtype, its length the number of bits) to ``values[b]``
    for each bit b of ``packed``, e.g. (-1, 1) for signs."""
    n = out.shape[0]
    if n == 0:
        return
    table = _table(array_module(out), out.dtype, values)
    whole = n // 8
    if whole:
        take(table, packed[:whole], out[: 8 * whole].reshape(whole, 8), axis=0)
    if n > 8 * whole:
        out[8 * whole :] = table[packed[whole]][: n - 8 * whole]


def _table(xp: Any, dtype: np.dtype, values: tuple[float, float]) -> Any:
    """The 256 x 8 table of ``values`` by bit, in ``dtype`` on ``xp``'s memory (cached)."""
    key = (xp, dtype, values)
    table = _tables.get(key)
    if table is None:
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
        table = _tables[key] = xp.asarray(np.where(bits == 1, values[1], values[0]).astype(dtype))
    return table
