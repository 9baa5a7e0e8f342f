"""Reduction operations: how two partial results combine, in place.

A :class:`Reduction` combines ``src`` into ``dst`` elementwise without
allocating (ufuncs with ``out=``). float16 is combined the way numpy and CuPy
do it, each element computed in float32 and rounded once; bfloat16 (carried as
uint16 bits) is combined through torch views of the same memory, again in
float32 per element and rounded to nearest even. ``avg`` combines as ``sum``
and divides once at the end (:meth:`Reduction.finalize`). The casts between
float32 and the 16-bit floats (:func:`widen`, :func:`narrow`, for the casting
compressors) need no torch: without it numpy does them, bit for bit as torch
on the host (NaNs: a NaN).

Operand order is explicit (``src_first``) so that two ranks combining the same
pair of partial results get bitwise-identical answers even for ops whose IEEE
result depends on the order (``min(-0.0, 0.0)``, NaN payloads).

:func:`widen` and :func:`narrow` convert half-precision buffers to and from a
float32 accumulator, for computations (weighted sums) that should round once.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Callable

import numpy as np

from ..errors import ArgumentError
from .buffers import FLOAT_DTYPES, array_module
from .scratch import scratch

#: Operation names every collective accepts.
OPS = ("sum", "avg", "min", "max", "prod")

_UFUNC_NAMES = {"sum": "add", "avg": "add", "min": "minimum", "max": "maximum", "prod": "multiply"}


class Reduction:
    """An op bound to a dtype and an array module (numpy or CuPy).

    Attributes:
        op: the op name, one of :data:`OPS`.
        dtype: the logical dtype name.
    """

    def __init__(self, op: str, dtype: str, xp: Any = np) -> None:
        self.op = op
        self.dtype = dtype
        if dtype == "bfloat16":
            self._ufunc = _bfloat16_ufunc(_UFUNC_NAMES[op])
        else:
            self._ufunc = getattr(xp, _UFUNC_NAMES[op])
        self._divide = _bfloat16_ufunc("divide") if dtype == "bfloat16" else xp.divide

    def combine(self, dst: Any, src: Any, src_first: bool = False) -> None:
        """Set ``dst <- op(dst, src)`` (or ``op(src, dst)`` if ``src_first``) in place."""
        if src_first:
            self._ufunc(src, dst, out=dst)
        else:
            self._ufunc(dst, src, out=dst)

    def fold(self, out: Any, operands: tuple[Any, ...]) -> None:
        """Set ``out <- op(...op(op(operands[0], operands[1]), operands[2])...)``, left to right
        (two or more operands; ``out`` may be the first)."""
        ufunc = self._ufunc
        ufunc(operands[0], operands[1], out=out)
        for a in operands[2:]:
            ufunc(out, a, out=out)

    def finalize(self, buf: Any, nranks: int) -> None:
        """Finish the reduction of ``nranks`` contributions in ``buf``: divide for avg."""
        if self.op == "avg" and nranks > 1:
            self._divide(buf, nranks, out=buf)


@cache
def reduction(op: str, dtype: str, xp: Any = np) -> Reduction:
    """The cached :class:`Reduction` for ``op`` on ``dtype`` with array module ``xp``.

    Raises:
        ArgumentError: unknown op, or ``avg`` on an integer dtype.
    """
    if op not in OPS:
        raise ArgumentError(f"unknown op {op!r}; valid ops: {', '.join(OPS)}")
    if op == "avg" and dtype not in FLOAT_DTYPES:
        raise ArgumentError(
            f"op 'avg' on integer dtype {dtype} would truncate; reduce with 'sum' "
            "and divide, or use a floating-point buffer"
        )
    return Reduction(op, dtype, xp)


def widen(src: Any, out: Any, dtype: str) -> None:
    """Set the float32 array ``out`` to the float16 or bfloat16 values in ``src``, exactly."""
    if dtype == "bfloat16" and isinstance(out, np.ndarray) and _host_torch() is None:
        _widen_bfloat16(src, out)
    elif dtype == "bfloat16":
        _float32_view(out).copy_(_bfloat16_view(src))
    elif isinstance(out, np.ndarray) and _host_torch() is not None:
        _host_torch().from_numpy(out).copy_(_host_torch().from_numpy(src))
    else:
        array_module(out).copyto(out, src)


def narrow(src: Any, out: Any, dtype: str) -> None:
    """Set the float16 or bfloat16 array ``out`` to the float32 ``src``, rounded to nearest even.

    numpy's float32 -> float16 cast takes a scalar path for values that become
    subnormal or overflow, which gradients are full of: 488 ms for 16.6 MiB of
    such values, against 12 ms through torch's vectorised cast (bitwise the
    same, infinities, NaN and subnormals included), so host arrays go through
    torch where it is installed (widening: 73 ms against 21 ms); bfloat16
    without torch by :func:`_narrow_bfloat16`, torch's rounding in numpy."""
    if dtype == "bfloat16" and isinstance(out, np.ndarray) and _host_torch() is None:
        _narrow_bfloat16(src, out)
    elif dtype == "bfloat16":
        _bfloat16_view(out).copy_(_float32_view(src))
    elif isinstance(out, np.ndarray) and _host_torch() is not None:
        _host_torch().from_numpy(out).copy_(_host_torch().from_numpy(src))
    else:
        array_module(out).copyto(out, src, casting="same_kind")


def _narrow_bfloat16(src: np.ndarray, out: np.ndarray) -> None:
    """Set the uint16 array ``out`` to the bfloat16 bits of ``src``, as torch rounds
    (c10::round_to_nearest_even): add 0x7FFF plus the lowest kept bit of the float32
    bits, keep the upper 16 bits; every NaN becomes the NaN 0xFFFF, as in torch's
    vectorised CPU cast. Other float types go through float32 first, as in torch.
    Temporaries are this thread's scratch (:mod:`.scratch`)."""
    n = src.shape[0]
    if src.dtype != np.float32:
        single = scratch(src, n, _BF16_SLOT, np.float32)
        np.copyto(single, src, casting="same_kind")
        src = single
    bits = src.view(np.uint32)
    wide = scratch(bits, n, _BF16_SLOT, np.uint32)
    np.right_shift(bits, 16, out=wide)
    wide &= 1
    wide += 0x7FFF
    wide += bits
    wide >>= 16
    np.copyto(out, wide, casting="unsafe")
    nan = np.isnan(src, out=scratch(bits, n, _BF16_SLOT, np.bool_))
    np.copyto(out, 0xFFFF, where=nan)


def _widen_bfloat16(src: np.ndarray, out: np.ndarray) -> None:
    """Set the float array ``out`` to the bfloat16 bits in ``src`` (float32's upper half);
    other float types than float32 through float32, as in torch."""
    wide = out if out.dtype == np.float32 else scratch(out, out.shape[0], _BF16_SLOT, np.float32)
    np.left_shift(src, 16, out=wide.view(np.uint32), dtype=np.uint32)
    if wide is not out:
        np.copyto(out, wide, casting="same_kind")


_BF16_SLOT = 0x6266  # the scratch of the bfloat16 casts without torch: no caller's slot


@cache
def _host_torch() -> Any:
    """torch, if it is installed (it casts float16 on the host far faster than numpy), else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _bfloat16_view(a: Any) -> Any:
    """A uint16 array holding bfloat16 bits, as a torch bfloat16 tensor (no copy)."""
    import torch

    if isinstance(a, np.ndarray):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.as_tensor(a.view("int16"), device=_device(torch, a)).view(torch.bfloat16)


def _float32_view(a: Any) -> Any:
    """A float32 array as a torch tensor (no copy)."""
    import torch

    return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.as_tensor(a, device=_device(torch, a))


def _device(torch: Any, a: Any) -> Any:
    """The torch device of the CuPy array ``a`` (its own: "cuda" alone would be the
    thread's current device, and a tensor there a copy)."""
    return torch.device("cuda", a.device.id)


def _bfloat16_ufunc(name: str) -> Callable[..., None]:
    """A ufunc-like callable on uint16 arrays holding bfloat16 bits.

    The arrays are viewed as torch bfloat16 tensors (no copy) and combined with
    the torch op of the same name; torch computes each element in float32 and
    rounds to nearest even. The second operand may be a Python scalar.
    """
    import torch

    op = getattr(
        torch, {"add": "add", "minimum": "minimum", "maximum": "maximum", "multiply": "mul", "divide": "div"}[name]
    )

    def apply(a: Any, b: Any, out: Any) -> None:
        op(_bfloat16_view(a), b if isinstance(b, (int, float)) else _bfloat16_view(b), out=_bfloat16_view(out))

    return apply
