"""The caller's buffer as one contiguous 1-D array that aliases its memory.

Every collective works in place on the array :func:`as_flat` returns: writing
to ``FlatBuffer.data`` writes to the caller's numpy array or torch tensor.
Nothing here copies. Inputs that cannot be viewed that way (non-contiguous,
read-only, an unsupported dtype or type) raise :class:`ArgumentError`.

bfloat16 has no numpy dtype, so a bfloat16 tensor is carried as its raw
``uint16`` bits; ``FlatBuffer.dtype`` keeps the logical name and the reduction
ops (:mod:`collectives.transport.ops`) know how to combine such bits.

numpy subclasses are host arrays: an ``np.memmap`` or ``np.matrix`` is viewed as
the plain array of its memory (reduced element-wise in place, as any array of
its shape); a masked array is refused, since its mask would be ignored.

Device buffers (CuPy arrays, CUDA tensors) enter through the same function once
their adapter is registered in :data:`DEVICE_ADAPTERS`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple

import numpy as np

from ..errors import ArgumentError

#: Logical dtype names every collective accepts.
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
NUMPY_DTYPES = tuple(name for name in DTYPES if name != "bfloat16")
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
_NUMPY_NAMES = {np.dtype(name): name for name in NUMPY_DTYPES}  # dtype.name is slow to compute

#: Adapters for device buffers, tried in order after numpy and CPU torch. Each
#: takes the caller's object and returns a FlatBuffer, or None if the object is
#: not of its kind.
DEVICE_ADAPTERS: list[Callable[[Any], FlatBuffer | None]] = []


class FlatBuffer(NamedTuple):
    """A contiguous 1-D array aliasing the memory of ``owner`` (a named tuple:
    built on every collective call, so it must be cheap).

    Attributes:
        data: numpy (or CuPy) 1-D array sharing memory with ``owner``.
        dtype: logical dtype name, one of :data:`DTYPES`.
        owner: the object the caller passed, returned by the collectives.
    """

    data: Any
    dtype: str
    owner: Any

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        """Number of bytes."""
        return int(self.data.nbytes)


def as_flat(buf: Any) -> FlatBuffer:
    """View ``buf`` as a contiguous 1-D array without copying.

    Raises:
        ArgumentError: the buffer type or dtype is unsupported, it is not
            C-contiguous, or it is read-only.
    """
    if isinstance(buf, np.ndarray):
        return _from_numpy(buf, buf)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor) and buf.device.type == "cpu":
        return _from_cpu_tensor(buf)
    for adapter in DEVICE_ADAPTERS:
        flat = adapter(buf)
        if flat is not None:
            return flat
    raise ArgumentError(
        f"unsupported buffer type {type(buf).__module__}.{type(buf).__qualname__}; "
        "expected a numpy.ndarray or a torch.Tensor" + (" (or a CuPy array / CUDA tensor)" if DEVICE_ADAPTERS else "")
    )


def array_module(data: Any) -> Any:
    """numpy for a numpy array, else the CuPy module of a device array."""
    if isinstance(data, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(data)


def dtype_code(flat: FlatBuffer) -> int:
    """An integer naming ``flat``'s dtype and memory, for cross-rank checks: the
    dtype's index in DTYPES, plus len(DTYPES) for device memory."""
    return DTYPES.index(flat.dtype) + (0 if type(flat.data) is np.ndarray else len(DTYPES))


#: Readable names of :func:`dtype_code` values.
DTYPE_CODES: dict[int, str] = {
    **dict(enumerate(DTYPES)),
    **{i + len(DTYPES): f"{d} (device)" for i, d in enumerate(DTYPES)},
}


def check_dtype(name: str, what: str) -> None:
    """Raise ArgumentError unless ``name`` is one of :data:`DTYPES`."""
    if name not in DTYPES:
        raise ArgumentError(f"unsupported dtype {name} of {what}; supported: {', '.join(DTYPES)}")


def check_layout(contiguous: bool, writable: bool, what: str) -> None:
    """Raise ArgumentError for a non-contiguous or read-only buffer."""
    if not contiguous:
        raise ArgumentError(
            f"{what} is not C-contiguous; collectives reduce in place and never "
            "copy, so pass a contiguous buffer (e.g. np.ascontiguousarray / "
            ".contiguous(), then use the result)"
        )
    if not writable:
        raise ArgumentError(f"{what} is read-only; collectives reduce in place and need a writable buffer")


def host_view(arr: np.ndarray) -> tuple[np.ndarray, str]:
    """A numpy array as a 1-D view of its memory and its dtype name, as in
    :func:`as_flat` but without the :class:`FlatBuffer` (the all-reduce's hot path).

    Raises:
        ArgumentError: as :func:`as_flat`.
    """
    name = _NUMPY_NAMES.get(arr.dtype)
    flags = arr.flags
    if name is None or (not flags.carray and not (flags.c_contiguous and flags.writeable)):  # carray: the common case
        what = f"numpy array (dtype {arr.dtype}, shape {arr.shape})"
        if not arr.dtype.isnative:
            raise ArgumentError(f"{what} has non-native byte order; convert it with .astype(dtype.newbyteorder('='))")
        check_dtype(arr.dtype.name, what)
        check_layout(flags.c_contiguous, flags.writeable, what)
    return arr if arr.ndim == 1 else arr.reshape(-1), name  # type: ignore[return-value]  # checked above


def _from_numpy(arr: np.ndarray, owner: Any) -> FlatBuffer:
    if type(arr) is not np.ndarray:
        arr = _plain(arr)
    data, name = host_view(arr)
    return FlatBuffer(data, name, owner)


def _plain(arr: np.ndarray) -> np.ndarray:
    """A numpy subclass's memory as a plain array (the collectives tell host memory by
    its exact type): an ``np.memmap`` is host memory like any other, an ``np.matrix``
    is its elements in order. A masked array is refused: its mask would be ignored."""
    if isinstance(arr, np.ma.MaskedArray):
        raise ArgumentError(
            f"masked array (dtype {arr.dtype}, shape {arr.shape}): the reduction would ignore its mask; "
            "pass arr.filled(value) or arr.data, then use the result"
        )
    return arr.view(np.ndarray)


def _from_cpu_tensor(t: Any) -> FlatBuffer:
    import torch

    name = str(t.dtype).removeprefix("torch.")
    what = f"torch tensor (dtype {name}, shape {tuple(t.shape)})"
    check_dtype(name, what)
    check_layout(t.is_contiguous(), True, what)
    plain = t.detach()
    if plain.dtype == torch.bfloat16:
        data = plain.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    else:
        data = plain.numpy().reshape(-1)
    return FlatBuffer(data, name, t)
