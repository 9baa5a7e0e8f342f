"""Device buffers: CuPy arrays and CUDA torch tensors, and how they reach MPI.

Buffers. A CuPy array is used as is; a CUDA torch tensor is viewed through
DLPack (``cupy.from_dlpack``), so both alias the caller's device memory and
nothing is copied. Reductions on them run on the device (CuPy ufuncs with
``out=``, on the current stream).

Transport, one of two paths for the whole process:

* ``direct``: the MPI library is GPU-aware; device pointers go to MPI as they
  are (mpi4py reads ``__cuda_array_interface__``).
* ``staged``: every message is copied through reusable pinned host buffers
  (device -> pinned, MPI on the host, pinned -> device).

Either way the current CUDA stream is synchronised before MPI reads a device
buffer, and before a received message overwrites one (a reduction kernel
queued on the stream may still be reading it). The path starts as ``staged``, which always works. :func:`configure`
(collective, once per communicator: called by the first device buffer
communicated on a communicator, and by ``mpidl info`` and ``mpidl bench``)
asks the library (``MPIX_Query_cuda_support``, where it exists) and, if it
claims support, confirms it with a tiny device-buffer exchange and
all-reduce checked against the expected values — some builds claim support
and then fail or return garbage. Only if every rank passes does the path
become ``direct``; otherwise it stays ``staged`` with one warning (a later
probe on another communicator that fails turns ``direct`` into ``staged``,
never back). ``MPIDL_GPU_DIRECT=0`` forces staging; ``=1`` skips the library
query (the probe still runs).

Host-only algorithms (the shared-memory all-reduce) run on a host copy of a
device buffer (:func:`on_host`).

Threads. CUDA's current device is a property of the thread, and a new thread
starts on device 0: a service thread of a rank on device 1 would allocate its
scratch and pinned staging buffers, synchronise its stream and launch its
reductions on device 0 (a context there that nobody asked for, kernels on
another device's arrays). So every thread that touches device buffers, other
than the caller's, calls :func:`use_device` with the device of the buffer it
serves (:func:`device_of`) when it starts: the training algorithms'
service threads (:class:`collectives.transport.background.Background`, AD-PSGD's
server). For host buffers that is nothing, once per thread. The caller's own
thread is the caller's to set (``torch.cuda.set_device``), as with any CUDA
library; ``mpidl train`` sets the rank's device.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..errors import ArgumentError
from . import buffers, p2p
from .buffers import FlatBuffer
from .scratch import scratch

_STAGE = 8  # scratch slot of :func:`on_host`


@dataclass
class Path:
    """How device buffers reach MPI, and why."""

    mode: str = "staged"
    reason: str = "not probed yet (staging always works)"
    probed: bool = False

    def __str__(self) -> str:
        return f"{self.mode} ({self.reason})"


PATH = Path()
_PROBED = MPI.Comm.Create_keyval()  # attribute: configure() has run on this communicator


# --- buffers ------------------------------------------------------------------


def _from_device(buf: Any) -> FlatBuffer | None:
    """The device-buffer adapter registered with :mod:`collectives.transport.buffers`."""
    module = type(buf).__module__
    if module.startswith("cupy"):
        return _from_cupy(buf, buf)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor) and buf.device.type == "cuda":
        return _from_cuda_tensor(buf)
    return None


def _from_cupy(arr: Any, owner: Any) -> FlatBuffer:
    what = f"CuPy array (dtype {arr.dtype}, shape {arr.shape})"
    buffers.check_dtype(arr.dtype.name, what)
    buffers.check_layout(arr.flags.c_contiguous, True, what)
    return FlatBuffer(arr.reshape(-1), arr.dtype.name, owner)


def _from_cuda_tensor(t: Any) -> FlatBuffer:
    import cupy
    import torch

    name = str(t.dtype).removeprefix("torch.")
    what = f"CUDA torch tensor (dtype {name}, shape {tuple(t.shape)})"
    buffers.check_dtype(name, what)
    buffers.check_layout(t.is_contiguous(), True, what)
    plain = t.detach()
    if plain.dtype == torch.bfloat16:
        arr = cupy.from_dlpack(plain.view(torch.int16)).view(cupy.uint16)
    else:
        arr = cupy.from_dlpack(plain)
    return FlatBuffer(arr.reshape(-1), name, t)


buffers.DEVICE_ADAPTERS.append(_from_device)


def device_of(buf: Any) -> int | None:
    """The CUDA device ordinal of ``buf`` (a CuPy array or a CUDA torch tensor), or
    None for host memory (a numpy array, a CPU tensor)."""
    if type(buf).__module__.startswith("cupy"):
        return int(buf.device.id)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor) and buf.device.type == "cuda":
        return int(buf.device.index)
    return None


def use_device(device: int | None) -> None:
    """Make ``device`` the calling thread's current CUDA device, for CuPy and for
    torch (if it has initialised CUDA), for the rest of the thread; None does nothing.

    A thread that allocates, stages or reduces device buffers calls it with
    :func:`device_of` the buffer it serves when it starts (module docstring).
    Nothing is restored: the device a new thread starts on is 0, and making it
    current again would create a context there (``cudaSetDevice`` does, since
    CUDA 12).
    """
    if device is None:
        return
    import cupy

    cupy.cuda.Device(device).use()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.set_device(device)


# --- transport ----------------------------------------------------------------


def synchronize() -> None:
    """Wait for the work queued on the current CUDA stream (before MPI reads or overwrites device memory)."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()


class _Direct:
    """GPU-aware MPI: device pointers go to MPI after a stream synchronisation."""

    def sendrecv(self, comm: MPI.Comm, send: Any, dest: int, recv: Any, source: int) -> None:
        synchronize()
        comm.Sendrecv([send, MPI.BYTE], dest, p2p.TAG, [recv, MPI.BYTE], source, p2p.TAG)

    def send(self, comm: MPI.Comm, buf: Any, dest: int) -> None:
        synchronize()
        comm.Send([buf, MPI.BYTE], dest, p2p.TAG)

    def recv(self, comm: MPI.Comm, buf: Any, source: int) -> None:
        synchronize()  # kernels still reading ``buf`` must finish before MPI overwrites it
        comm.Recv([buf, MPI.BYTE], source, p2p.TAG)

    def isend(self, comm: MPI.Comm, buf: Any, dest: int) -> MPI.Request:
        synchronize()
        return comm.Isend([buf, MPI.BYTE], dest, p2p.TAG)

    def irecv(self, comm: MPI.Comm, buf: Any, source: int) -> MPI.Request:
        synchronize()
        return comm.Irecv([buf, MPI.BYTE], source, p2p.TAG)


class _Staged:
    """Copies through reusable pinned host buffers: two (one out, one in) per thread for
    the blocking calls, and a per-thread pool for transfers in flight together."""

    def __init__(self) -> None:
        import threading

        self._local = threading.local()

    def _pinned(self, slot: int, nbytes: int) -> np.ndarray:
        import cupy

        cache = getattr(self._local, "pinned", None)
        if cache is None:
            cache = self._local.pinned = {}
        host = cache.get(slot)
        if host is None or host.nbytes < nbytes:
            mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1 << 16))
            host = cache[slot] = np.frombuffer(mem, np.uint8, mem.size())
        return host[:nbytes]

    def _to_host(self, dev: Any) -> np.ndarray:
        host = self._pinned(0, dev.nbytes)
        synchronize()
        dev.view(np.uint8).get(out=host)
        return host

    def _to_device(self, host: np.ndarray, dev: Any) -> None:
        synchronize()  # kernels still reading ``dev`` (the last combine) must finish first
        dev.view(np.uint8).set(host)  # synchronous: the pinned buffer is reused next

    def sendrecv(self, comm: MPI.Comm, send: Any, dest: int, recv: Any, source: int) -> None:
        out = self._to_host(send)
        into = self._pinned(1, recv.nbytes)
        comm.Sendrecv([out, MPI.BYTE], dest, p2p.TAG, [into, MPI.BYTE], source, p2p.TAG)
        self._to_device(into, recv)

    def send(self, comm: MPI.Comm, buf: Any, dest: int) -> None:
        comm.Send([self._to_host(buf), MPI.BYTE], dest, p2p.TAG)

    def recv(self, comm: MPI.Comm, buf: Any, source: int) -> None:
        into = self._pinned(1, buf.nbytes)
        comm.Recv([into, MPI.BYTE], source, p2p.TAG)
        self._to_device(into, buf)

    def isend(self, comm: MPI.Comm, buf: Any, dest: int) -> _StagedPending:
        host = self._take(buf.nbytes)
        synchronize()
        buf.view(np.uint8).get(out=host)
        return _StagedPending(self, comm.Isend([host, MPI.BYTE], dest, p2p.TAG), host)

    def irecv(self, comm: MPI.Comm, buf: Any, source: int) -> _StagedPending:
        host = self._take(buf.nbytes)
        return _StagedPending(self, comm.Irecv([host, MPI.BYTE], source, p2p.TAG), host, buf)

    def _take(self, nbytes: int) -> np.ndarray:
        """A pinned buffer of ``nbytes`` from this thread's pool, for one transfer in flight."""
        import cupy

        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = []
        for i, host in enumerate(pool):
            if host.nbytes >= nbytes:
                return pool.pop(i)[:nbytes]
        mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1 << 16))
        return np.frombuffer(mem, np.uint8, mem.size())[:nbytes]

    def _give_back(self, host: np.ndarray) -> None:
        """Return a buffer from :meth:`_take` to the pool (on the thread that took it)."""
        self._local.pool.append(host.base)


class _StagedPending:
    """A staged nonblocking transfer: on completion (``Wait``, or a ``Test`` that
    finds it done) a received message is copied to the device and the pinned
    buffer goes back to the pool."""

    def __init__(self, transport: _Staged, request: MPI.Request, host: np.ndarray, device: Any = None) -> None:
        self.transport, self.request, self.host, self.device = transport, request, host, device
        self.done = False

    def Wait(self) -> None:
        if not self.done:
            self.request.Wait()
            self._finish()

    def Test(self) -> bool:
        if not self.done and self.request.Test():
            self._finish()
        return self.done

    def _finish(self) -> None:
        self.done = True
        if self.device is not None:
            self.transport._to_device(self.host, self.device)
        self.transport._give_back(self.host)


def _install(mode: str) -> None:
    import cupy

    p2p.DEVICE_TRANSPORTS[cupy.ndarray] = _Direct() if mode == "direct" else _Staged()
    PATH.mode = mode


# --- detection ----------------------------------------------------------------


def query_cuda_support() -> bool | None:
    """What the MPI library says (``MPIX_Query_cuda_support``), or None if it has no such call."""
    for path in _loaded_mpi_libraries():
        try:
            fn = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return bool(fn())
    return None


def _loaded_mpi_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and ".so" in line}
    except OSError:
        return []
    return sorted(paths)


def available() -> bool:
    """Whether CuPy imports and sees at least one GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or a CUDA runtime error without a driver/GPU
        return False


def configure(comm: MPI.Comm) -> Path:
    """Decide the device transport for this process (collective over ``comm`` on
    the first call with it; later calls with it return the decision).

    The probe is per communicator: every rank of ``comm`` takes part in it
    the first time it is called with ``comm``, whatever other communicators
    it probed on before, so a process probed on a sub-communicator still
    joins the probe on the whole (it returned early and left the others
    waiting). The transport is one for the process: ``direct`` while every
    probe it took part in confirmed it, ``staged`` from the first that did
    not. The ranks of ``comm`` decide alike: the probe runs only if every
    rank may try it, and passes only if it passes on every rank.
    """
    if comm.Get_attr(_PROBED):
        return PATH
    here = available()
    forced = os.environ.get("MPIDL_GPU_DIRECT", "").strip()
    claims = query_cuda_support() if here else None
    if not here:
        why = "no CUDA device or CuPy not installed"
    elif forced == "0":
        why = "forced by MPIDL_GPU_DIRECT=0"
    elif claims is False and forced != "1":
        why = "MPIX_Query_cuda_support() = 0: the MPI library is not GPU-aware"
    else:
        why = ""
    ok = False
    if comm.allreduce(not why, op=MPI.LAND):  # every rank may try the device path
        ok = bool(comm.allreduce(_probe(comm), op=MPI.LAND))
        said = {
            None: "the library has no MPIX_Query_cuda_support",
            True: "MPIX_Query_cuda_support() = 1",
            False: "MPIX_Query_cuda_support() = 0, overridden by MPIDL_GPU_DIRECT=1",
        }[claims]
        why = (
            f"{said}; confirmed by a device send/receive and all-reduce"
            if ok
            else f"{said}, but the device-buffer probe failed on some rank"
        )
    elif not why:
        why = "another rank cannot use device buffers directly"
    comm.Set_attr(_PROBED, True)
    if not here:
        PATH.mode, PATH.reason, PATH.probed = "none", why, True
    elif not PATH.probed or (PATH.mode == "direct" and not ok):
        _install("direct" if ok else "staged")
        PATH.reason, PATH.probed = why if ok else f"{why}; staging through pinned host memory", True
        if not ok and comm.Get_rank() == 0:
            warnings.warn(f"mpidl: device buffers are staged through host memory: {PATH.reason}", stacklevel=2)
    return PATH


def _probe(comm: MPI.Comm) -> bool:
    """Exchange and all-reduce tiny device buffers with raw MPI; True if the values are right."""
    import cupy

    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        send = cupy.arange(4, dtype=cupy.int32) + rank
        recv = cupy.zeros(4, dtype=cupy.int32)
        synchronize()
        comm.Sendrecv([send, MPI.INT], (rank + 1) % size, 0x6D73, [recv, MPI.INT], (rank - 1) % size, 0x6D73)
        total = cupy.zeros(4, dtype=cupy.int32)
        comm.Allreduce([send, MPI.INT], [total, MPI.INT], op=MPI.SUM)
        expected_total = np.arange(4) * size + size * (size - 1) // 2
        return bool((recv.get() == np.arange(4) + (rank - 1) % size).all()) and bool(
            (total.get() == expected_total).all()
        )
    except Exception:  # an MPI error or a CUDA error: either way, not usable
        return False


def on_host(x: Any, fn: Callable[[np.ndarray], None]) -> None:
    """Run ``fn`` on a host copy of the device array ``x`` (a reusable per-thread
    buffer), then copy the host array back into ``x``; if ``fn`` raises, ``x``
    is untouched. For host-only algorithms (:mod:`collectives.kernels.shm`)."""
    host = scratch(np.empty(0, x.dtype), x.shape[0], slot=_STAGE)
    synchronize()
    x.get(out=host)
    fn(host)
    x.set(host)


def ensure(comm: MPI.Comm, flat: FlatBuffer) -> None:
    """Make sure a device path is chosen before ``flat`` (a device buffer) is communicated
    on ``comm`` (collective on the first device buffer with ``comm``: :func:`configure`)."""
    if type(flat.data) is not np.ndarray and not comm.Get_attr(_PROBED):
        configure(comm)
    if PATH.mode == "none" and type(flat.data) is not np.ndarray:
        raise ArgumentError("a device buffer was given but no CUDA device is usable")
