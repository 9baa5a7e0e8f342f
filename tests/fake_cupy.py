"""A stand-in for CuPy on a machine without a GPU: host arrays that say which device they
are on, a current device per thread, and a record of every device operation.

It is enough of CuPy for the collectives' device paths (the staged transport,
scratch, the reductions) and the algorithms on top of them: ``install()`` puts it in
``sys.modules["cupy"]`` and routes its arrays through :mod:`collectives.transport.gpu`
as a real CuPy's would go. Each allocation, kernel, stream synchronisation, copy
between host and device and pinned allocation is recorded in :data:`EVENTS` with the
thread that made it, the thread's current device then, and the devices of the arrays
it touched, so a test can check that every thread worked on the device its buffers
are on. A thread starts on device 0, as with CUDA.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any, NamedTuple

import numpy as np
import pytest

from collectives.transport import gpu, p2p


class Event(NamedTuple):
    """One device operation: which thread, what, on which current device, on arrays of which devices."""

    thread: str
    what: str
    current: int
    arrays: tuple[int, ...]


#: Every device operation since the last :func:`install`.
EVENTS: list[Event] = []
_state = threading.local()


def current() -> int:
    """The calling thread's current device (0 until it sets one)."""
    return getattr(_state, "device", 0)


def _note(what: str, *arrays: Any) -> None:
    devices = tuple(a.device.id for a in arrays if isinstance(a, ndarray))
    EVENTS.append(Event(threading.current_thread().name, what, current(), devices))


class Device:
    """``cupy.cuda.Device``: ``use()`` makes it current for the thread; a context restores the previous one."""

    def __init__(self, device: int | None = None) -> None:
        self.id = current() if device is None else int(device)
        self._previous: list[int] = []

    def use(self) -> None:
        _state.device = self.id

    def __enter__(self) -> Device:
        self._previous.append(current())
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.device = self._previous.pop()


class ndarray:
    """A host array that claims to live on ``device``; views share its memory."""

    def __init__(self, host: np.ndarray, device: int) -> None:
        self.host, self.device = host, Device(device)

    shape = property(lambda self: self.host.shape)
    dtype = property(lambda self: self.host.dtype)
    nbytes = property(lambda self: self.host.nbytes)
    itemsize = property(lambda self: self.host.itemsize)
    size = property(lambda self: self.host.size)
    flags = property(lambda self: self.host.flags)

    def _like(self, host: np.ndarray) -> ndarray:
        return ndarray(host, self.device.id)

    def reshape(self, *shape: Any) -> ndarray:
        return self._like(self.host.reshape(*shape))

    def view(self, dtype: Any) -> ndarray:
        return self._like(self.host.view(dtype))

    def __getitem__(self, key: Any) -> ndarray:
        return self._like(self.host[key])

    def __setitem__(self, key: Any, value: Any) -> None:
        _note("setitem", self, value)
        self.host[key] = _host(value)

    def __len__(self) -> int:
        return len(self.host)

    def fill(self, value: Any) -> None:
        _note("fill", self)
        self.host.fill(value)

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        _note("device to host", self)
        if out is None:
            return self.host.copy()
        out[...] = self.host
        return out

    def set(self, host: np.ndarray) -> None:
        _note("host to device", self)
        self.host[...] = host


ndarray.__module__ = "cupy"  # how collectives.transport.gpu recognises CuPy arrays


def _host(a: Any) -> Any:
    return a.host if isinstance(a, ndarray) else a


def _allocated(host: np.ndarray) -> ndarray:
    arr = ndarray(host, current())
    _note("allocate", arr)
    return arr


def empty(shape: Any, dtype: Any = np.float64) -> ndarray:
    return _allocated(np.empty(shape, dtype))


def zeros(shape: Any, dtype: Any = np.float64) -> ndarray:
    return _allocated(np.zeros(shape, dtype))


def asarray(a: Any) -> ndarray:
    return _allocated(np.array(_host(a)))


def _kernel(name: str) -> Any:
    ufunc = getattr(np, name)

    def launch(a: Any, b: Any, out: ndarray) -> None:
        _note(name, a, b, out)
        ufunc(_host(a), _host(b), out=out.host)

    return launch


add, subtract, multiply, divide, minimum, maximum = map(
    _kernel, ("add", "subtract", "multiply", "divide", "minimum", "maximum")
)


def copyto(dst: ndarray, src: Any, casting: str = "same_kind") -> None:
    _note("copyto", dst, src)
    np.copyto(dst.host, _host(src), casting=casting)


def get_array_module(*arrays: Any) -> Any:
    return sys.modules[__name__]


class _Stream:
    def synchronize(self) -> None:
        _note("synchronize")


class _Pinned(bytearray):
    def size(self) -> int:
        return len(self)


def _alloc_pinned_memory(nbytes: int) -> _Pinned:
    _note("pinned allocate")
    return _Pinned(nbytes)


cuda = types.SimpleNamespace(
    Device=Device,
    get_current_stream=lambda: _Stream(),
    alloc_pinned_memory=_alloc_pinned_memory,
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 2, getDevice=current),
)


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this module ``cupy`` for the test, with the staged transport for its arrays; clear :data:`EVENTS`."""
    monkeypatch.setitem(sys.modules, "cupy", sys.modules[__name__])
    monkeypatch.setitem(p2p.DEVICE_TRANSPORTS, ndarray, gpu._Staged())
    monkeypatch.setattr(gpu, "PATH", gpu.Path("staged", "the fake CuPy of the tests", True))
    monkeypatch.setattr(_state, "device", 0, raising=False)  # the calling thread starts over on device 0
    EVENTS.clear()


def on(device: int, values: np.ndarray) -> ndarray:
    """A device array on ``device`` holding a copy of ``values`` (made without an event)."""
    return ndarray(np.array(values), device)


def elsewhere(device: int) -> list[Event]:
    """The events not on ``device``: made with another device current, or touching an array of another device."""
    return [e for e in EVENTS if e.current != device or any(d != device for d in e.arrays)]
