"""The compressor interface: encode a float vector into bytes, decode them, aggregate across ranks.

A compressor C maps a vector x of d floats to a *payload* of bytes and back
to C(x), its decoded approximation. Every compressor offers:

* ``compress(buf) -> payload``: the payload of ``buf`` (a 1-D uint8 array
  of :meth:`~Compressor.payload_nbytes` bytes, in reusable memory: valid
  until this thread's next ``compress`` or ``allreduce``, with any compressor);
* ``decompress(payload, out, add=False)``: sets ``out`` to C(x), or adds
  C(x) to it;
* ``allreduce(buf, comm, op, residual=...)``: sets ``buf``, on every rank,
  to the sum or average over the ranks of what they sent, bitwise identical
  on all ranks, with the aggregation the compressor needs
  (:attr:`~Compressor.aggregation`):

  - ``allreduce`` (linear compressors: random-k, PowerSGD, none): the
    compressed vectors themselves are summed by an all-reduce
    (:func:`collectives.allreduce`, any algorithm);
  - ``allgather`` (:mod:`.aggregate`): every rank's payload reaches every
    rank, which decodes and sums them in rank order;
  - ``reduce_scatter`` (:mod:`.aggregate`): the vector is cut into one
    chunk per rank; each rank's encoding of chunk j goes to rank j, which
    decodes and sums them, encodes the sum again, and sends that to every
    rank.
* ``check(buf, comm, op, ...)``: raises what ``allreduce`` would raise for
  the same arguments, and does nothing else (e.g. before the caller writes
  into ``buf``: :mod:`algorithms.error_feedback`).

Residual. ``allreduce(..., residual=e)`` also writes into ``e`` (same length
and dtype as ``buf``) this rank's share of what the aggregate lost: x - C(x),
plus, on the rank that encoded a chunk of the sum a second time
(``reduce_scatter``), that second encoding's error times the number of ranks
(for ``avg``; once for ``sum``). So that, summed over the ranks,

    sum_i x_i = n * result + sum_i e_i     (avg; sum: result + sum_i e_i)

up to rounding: what error feedback (:mod:`algorithms.error_feedback`)
carries into the next step, so that no part of a gradient is lost for good.

Server memory. ``allreduce(..., residual=e, server=s)`` (``reduce_scatter``;
``s`` like ``buf``, kept between calls) keeps the second encoding's error
apart, as DoubleSqueeze does (Tang, Yu, Lian, Zhang & Liu, ICML 2019): the
owner of chunk j adds its part of ``s`` to the chunk's sum (average) before
encoding it again and keeps that encoding's error there, in the units of the
result; ``e`` gets x - C(x) alone. Then, with s' the memory after the call,

    sum_i x_i + n sum_i s_i = n * result + sum_i e_i + n sum_i s'_i   (avg)

(sum: s and s' once). Folding n times the second error into the owner's
residual instead sends it through the owner's first encoding, scaled by n,
next step: with sign, whose scale follows the largest values, the owner's
gradient is lost under it and training stalls (measured: 67 % instead of
96 % on digits, docs/training.rst); with the server memory, error feedback
with sign trains as well as without compression. Other aggregations ignore
``server``.

Precision. Compressors compute in float32, or in float64 for float64
buffers (the *work* precision): float16 and bfloat16 buffers are widened into
reusable float32 memory first and the results rounded back once. Scales and
values travel in the work precision, except in the casts.

Attributes of every compressor: :attr:`~Compressor.spec` (its name and
parameter, as :func:`collectives.compression.create` parses it),
:attr:`~Compressor.unbiased` (E[C(x)] = x), :attr:`~Compressor.feedback`
(error feedback is on by default: top-k and PowerSGD; sign trained
better without it), :attr:`~Compressor.aggregation`.

Memory. Everything a step needs lives in reusable per-thread memory
(:func:`collectives.transport.scratch.scratch`), so steady-state steps
allocate no buffer of the vector's size (library calls allocate O(k) index
arrays in top-k and random-k, and O(rows x r) in PowerSGD's QR).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from mpi4py import MPI

from .. import validation
from ..api import COLLECTIVES, DEFAULT_COLLECTIVE
from ..errors import ArgumentError, renamed_keyword
from ..transport import gpu, p2p
from ..transport.buffers import DTYPE_CODES, FLOAT_DTYPES, FlatBuffer, array_module, as_flat, dtype_code
from ..transport.context import Context, context
from ..transport.ops import narrow, widen
from ..transport.scratch import scratch
from . import aggregate
from .aggregate import Call
from .memory import DECODED, EXTRA, PAYLOAD, RESIDUAL, SERVER, WORK

#: Ops a compressed aggregation supports.
OPS = ("sum", "avg")

#: A layout: (offset, shape) of every layer (tensor) of a buffer, in the buffer's order.
Shapes = Sequence[tuple[int, Sequence[int]]]

HALF = frozenset({"float16", "bfloat16"})


def work_dtype(dtype: str) -> np.dtype:
    """The precision a compressor computes in for a buffer of logical ``dtype``."""
    return np.dtype(np.float64 if dtype == "float64" else np.float32)


def round8(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 8, so that the next payload starts aligned."""
    return -(-nbytes // 8) * 8


def bucket_views(a: Any, size: int) -> list[Any]:
    """``a`` (1-D) as 2-D views of whole buckets of ``size`` elements, then the shorter
    last bucket (one row) if there is one: one vectorised pass per view."""
    full = a.shape[0] // size * size
    views = [a[:full].reshape(-1, size)] if full else []
    if full < a.shape[0]:
        views.append(a[full:].reshape(1, -1))
    return views


def bucket_rows(views: list[Any], per_bucket: Any) -> list[Any]:
    """``per_bucket`` (one value per bucket) cut to match :func:`bucket_views`, as columns."""
    out, start = [], 0
    for v in views:
        out.append(per_bucket[start : start + v.shape[0], None])
        start += v.shape[0]
    return out


def layer_bounds(shapes: Shapes, name: str) -> list[tuple[int, int, tuple[int, ...]]]:
    """(start, stop, shape) of every layer of ``shapes``; ArgumentError (naming the
    compressor ``name``) unless the layout tiles the buffer from 0 in order, without
    gaps or overlaps."""
    bounds: list[tuple[int, int, tuple[int, ...]]] = []
    end = 0
    for i, entry in enumerate(shapes):
        try:
            offset, shape = entry
            offset, dims = int(offset), tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise ArgumentError(f"{name}: layout entry {i} must be (offset, shape), got {entry!r}") from None
        if offset != end:
            raise ArgumentError(
                f"{name}: layout entry {i} starts at {offset}, but the layers before it end at {end}: "
                "the layout must tile the buffer in order, without gaps or overlaps"
            )
        if any(d < 0 for d in dims):
            raise ArgumentError(f"{name}: layout entry {i} has a negative dimension: {dims}")
        end = offset + math.prod(dims)
        bounds.append((offset, end, dims))
    return bounds


class Compressor(ABC):
    """A gradient or model compressor (module docstring).

    Subclasses implement the codec on work-precision arrays: :meth:`_nbytes`,
    :meth:`_encode`, :meth:`_decode`, and :meth:`_aggregate` unless the
    aggregation is one of :mod:`.aggregate`'s.

    Args:
        aggregation: one of the class's :attr:`aggregations` (the first is the default).
        seed: seeds this compressor's random numbers (the stream of a stochastic
            compressor also depends on the process's rank in ``MPI_COMM_WORLD``,
            so workers draw independently; shared draws, such as random-k's
            indices, depend on the seed only).

    Attributes:
        spec: the name and parameter, e.g. "qsgd:127", and the aggregation where it
            is not the default ("sign@allgather"): what
            :func:`collectives.compression.create` builds this compressor from.
        aggregation: how :meth:`allreduce` combines the ranks' contributions.
        bucket: chunk boundaries of ``reduce_scatter`` fall on multiples of this
            many elements (the codec's scales are per bucket).
    """

    #: The name in :data:`collectives.compression.COMPRESSORS`.
    name: ClassVar[str]
    #: The parameter after the colon in a spec: (its name, its type), or None.
    param: ClassVar[tuple[str, type] | None] = None
    #: E[C(x)] = x.
    unbiased: ClassVar[bool] = False
    #: Error feedback is on by default (:mod:`algorithms.error_feedback`).
    feedback: ClassVar[bool] = False
    #: Supported aggregations, the default first.
    aggregations: ClassVar[tuple[str, ...]] = ("allreduce",)

    bucket = 1

    def __init__(self, *, aggregation: str | None = None, seed: int = 0) -> None:
        chosen = self.aggregations[0] if aggregation is None else aggregation
        if chosen not in self.aggregations:
            *others, last = self.aggregations
            ways = f"{', '.join(others)} or {last}" if others else last
            raise ArgumentError(f"compressor {self.name!r} aggregates by {ways}, not {aggregation!r}")
        self.aggregation = chosen
        self.seed = int(seed)
        self.spec = self.name
        self._rng: dict[Any, Any] = {}

    @property
    def spec(self) -> str:
        """The name and parameter, then ``@aggregation`` where it is not the default."""
        default = self.aggregation == self.aggregations[0]
        return self._spec if default else f"{self._spec}@{self.aggregation}"

    @spec.setter
    def spec(self, text: str) -> None:
        self._spec = text

    def __repr__(self) -> str:
        return f"<compressor {self.spec} ({self.aggregation})>"

    @classmethod
    def from_param(cls, text: str | None, **options: Any) -> Compressor:
        """Build from the text after the colon of a spec (None: the default parameter)."""
        if text is None:
            return cls(**options)
        if cls.param is None:
            raise ArgumentError(f"compressor {cls.name!r} takes no parameter, got {cls.name}:{text}")
        what, kind = cls.param
        try:
            value = kind(text)
        except ValueError:
            raise ArgumentError(f"{cls.name}:{text}: the {what} must be {kind.__name__}, got {text!r}") from None
        return cls(value, **options)  # type: ignore[call-arg]  # subclasses with a param take it first

    # --- the public API -----------------------------------------------------------

    def payload_nbytes(self, length: int, dtype: str = "float32") -> int:
        """Bytes of the payload of a buffer of ``length`` elements of logical ``dtype``."""
        return self._nbytes(length, work_dtype(dtype))

    def compress(self, buf: Any) -> Any:
        """The payload of ``buf`` (a float buffer of any kind); reusable memory, valid
        until this thread's next ``compress`` or ``allreduce``. Stateful compressors advance their
        state (random-k draws the step's indices, PowerSGD warm-starts the next step)."""
        flat = float_buffer(buf, "compress")
        x = self._work(flat)
        payload = scratch(x, self._nbytes(flat.size, x.dtype), PAYLOAD, np.uint8)
        self._encode(x, payload)
        return payload

    def decompress(self, payload: Any, out: Any, *, add: bool = False) -> Any:
        """Set ``out`` to the vector ``payload`` encodes (or add it, with ``add``) and
        return ``out``; ``out`` has the length and a float dtype of the compressed
        buffer (random-k: decompress the current step's payloads, see its module)."""
        flat = float_buffer(out, "decompress")
        data = payload.reshape(-1).view(np.uint8)
        expected = self.payload_nbytes(flat.size, flat.dtype)
        if data.nbytes != expected:
            raise ArgumentError(
                f"{self.spec}: a payload for {flat.size} {flat.dtype} elements has {expected} bytes, got {data.nbytes}"
            )
        if flat.dtype not in HALF:
            (self._decode_add if add else self._decode)(data, flat.data)
            return out
        w = scratch(flat.data, flat.size, DECODED, np.float32)
        if add:
            widen(flat.data, w, flat.dtype)
            self._decode_add(data, w)
        else:
            self._decode(data, w)
        narrow(w, flat.data, flat.dtype)
        return out

    def allreduce(
        self,
        buf: Any,
        comm: MPI.Comm | None = None,
        op: str = "avg",
        *,
        residual: Any = None,
        server: Any = None,
        collective: str = DEFAULT_COLLECTIVE,
        validate: bool | None = None,
        algorithm: str | None = None,
    ) -> Any:
        """Set ``buf`` on every rank of ``comm`` to the sum or average of the ranks'
        compressed ``buf`` (bitwise identical on all ranks) and return it.

        Args:
            buf: a C-contiguous, writable float buffer (numpy, torch, CuPy) of any
                shape; the same length and dtype on every rank.
            comm: the communicator (default ``MPI.COMM_WORLD``); every rank calls
                with the same compressor spec, op and collective.
            op: "avg" or "sum".
            residual: None, or a buffer of ``buf``'s length and dtype that receives
                this rank's share of what the aggregate lost (module docstring).
            server: None, or a buffer like ``residual`` that keeps the error of the
                second encoding of ``reduce_scatter`` between calls, read and
                updated in the part of the chunk this rank owns (module docstring).
            collective: the all-reduce algorithm of the linear compressors
                (:data:`collectives.COLLECTIVES`).
            validate: check the arguments across ranks first (None: the default,
                on unless ``MPIDL_VALIDATE=0``).
            algorithm: the old name of ``collective`` (deprecated).

        Raises:
            ArgumentError: bad or disagreeing arguments; with validation on, on
                every rank before any data moved.
        """
        collective = renamed_keyword(
            "Compressor.allreduce", "algorithm", "collective", algorithm, collective, DEFAULT_COLLECTIVE
        )
        user = MPI.COMM_WORLD if comm is None else comm
        ctx = context(user)
        flat, res, memory = self._checked(ctx, buf, op, residual, server, collective, validate)
        if type(flat.data) is not np.ndarray:
            gpu.ensure(ctx.comm, flat)
        if flat.size:
            x = self._work(flat)
            half = flat.dtype in HALF
            r = None if res is None else (scratch(x, flat.size, RESIDUAL) if half else res.data)
            s = None if memory is None else (scratch(x, flat.size, SERVER) if half else memory.data)
            if half and memory is not None:
                widen(memory.data, s, flat.dtype)
            self._aggregate(x, r, Call(user, ctx, op, collective, s))
            if half:
                narrow(x, flat.data, flat.dtype)
                for wide, buffer in ((r, res), (s, memory)):
                    if buffer is not None:
                        narrow(wide, buffer.data, flat.dtype)
        return buf

    def check(
        self,
        buf: Any,
        comm: MPI.Comm | None = None,
        op: str = "avg",
        *,
        residual: Any = None,
        server: Any = None,
        collective: str = DEFAULT_COLLECTIVE,
        validate: bool | None = None,
        algorithm: str | None = None,
    ) -> None:
        """Raise the ArgumentError that :meth:`allreduce` would raise for these arguments,
        before it moved any data (with validation on, on every rank: collective), and
        change nothing: e.g. to check them before writing into ``buf``.

        Raises:
            ArgumentError: bad or disagreeing arguments.
        """
        collective = renamed_keyword(
            "Compressor.check", "algorithm", "collective", algorithm, collective, DEFAULT_COLLECTIVE
        )
        ctx = context(MPI.COMM_WORLD if comm is None else comm)
        self._checked(ctx, buf, op, residual, server, collective, validate)

    # --- what subclasses implement ------------------------------------------------

    @abstractmethod
    def _nbytes(self, length: int, dtype: np.dtype) -> int:
        """Payload bytes for ``length`` elements of work precision ``dtype``."""

    @abstractmethod
    def _encode(self, x: Any, out: Any) -> None:
        """Write the payload of ``x`` (work precision) into the uint8 array ``out``."""

    @abstractmethod
    def _decode(self, payload: Any, out: Any) -> None:
        """Set ``out`` (work precision) to the vector ``payload`` encodes."""

    def _decode_add(self, payload: Any, out: Any) -> None:
        """Add the vector ``payload`` encodes to ``out``."""
        tmp = scratch(out, out.shape[0], EXTRA)
        self._decode(payload, tmp)
        array_module(out).add(out, tmp, out=out)

    def _residual(self, x: Any, payload: Any, out: Any) -> None:
        """Set ``out`` to ``x`` less the vector ``payload`` encodes (``payload`` being
        ``x``'s encoding): what error feedback carries to the next step."""
        self._decode(payload, out)
        array_module(x).subtract(x, out, out=out)

    def piece(self, start: int, stop: int) -> Compressor:
        """The codec of elements ``start`` to ``stop`` of the vectors this compressor
        encodes (the chunks of ``reduce_scatter``): itself, unless its encoding depends
        on where an element lies (sign's scales per layer)."""
        return self

    def _aggregate(self, x: Any, residual: Any, call: Call) -> None:
        """Replace ``x`` (work precision) by the aggregate; write the residual if asked."""
        aggregations = {"allgather": aggregate.gather, "hierarchical": aggregate.hierarchical}
        aggregations.get(self.aggregation, aggregate.scatter)(self, x, residual, call)

    def _check(self, flat: FlatBuffer) -> None:
        """Raise ArgumentError if this compressor cannot take ``flat`` (beyond the common checks)."""

    # --- helpers --------------------------------------------------------------------

    def _random(self, xp: Any) -> Any:
        """This process's generator of ``xp`` (numpy or CuPy): seeded by the seed and
        the world rank, created on first use."""
        rng = self._rng.get(xp)
        if rng is None:
            seq = np.random.SeedSequence([self.seed, MPI.COMM_WORLD.Get_rank()])
            rng = np.random.default_rng(seq) if xp is np else xp.random.default_rng(int(seq.generate_state(1)[0]))
            self._rng[xp] = rng
        return rng

    def _work(self, flat: FlatBuffer) -> Any:
        """``flat`` in work precision: itself, or (half precision) a widened copy."""
        if flat.dtype not in HALF:
            return flat.data
        x = scratch(flat.data, flat.size, WORK, np.float32)
        widen(flat.data, x, flat.dtype)
        return x

    def _checked(
        self, ctx: Context, buf: Any, op: str, residual: Any, server: Any, algorithm: str, validate: bool | None
    ) -> tuple[FlatBuffer, FlatBuffer | None, FlatBuffer | None]:
        """The buffers resolved, once the arguments are checked locally and, with validation
        on, across ranks (:meth:`check`)."""
        what = "compressed allreduce"  # the same on every rank, whatever each passed
        p2p.operation(f"{what} ({self.spec})")
        flat, res, memory, problem = self._prepare(buf, op, residual, server, algorithm)
        if validation.enabled(validate):
            signature = (0,) * 5
            if problem is None:
                signature = (
                    flat.size,
                    dtype_code(flat),
                    validation.code(op),
                    validation.code(f"{self.name}/{self.aggregation}"),
                    validation.code(self._options(algorithm)),
                )
            validation.check(ctx, what, problem, signature, lambda: self._field_names(algorithm))
        elif problem is not None:
            raise problem
        return flat, res, memory

    def _prepare(
        self, buf: Any, op: str, residual: Any, server: Any, algorithm: str
    ) -> tuple[FlatBuffer, FlatBuffer | None, FlatBuffer | None, ArgumentError | None]:
        """Resolve the buffers and check the arguments locally; a problem is returned, not raised."""
        try:
            flat = float_buffer(buf, f"{self.spec} allreduce")
            if op not in OPS:
                raise ArgumentError(f"compressed allreduce supports ops {', '.join(OPS)}, not {op!r}")
            if algorithm not in COLLECTIVES:
                raise ArgumentError(f"unknown collective {algorithm!r}; valid collectives: {', '.join(COLLECTIVES)}")
            res, memory = (
                None if b is None else _matching(b, flat, what)
                for b, what in ((residual, "residual"), (server, "server memory"))
            )
            self._check(flat)
            return flat, res, memory, None
        except ArgumentError as exc:
            return None, None, None, exc  # type: ignore[return-value]  # unused when there is a problem

    def _options(self, algorithm: str) -> str:
        """The parameters every rank must agree on beyond the name and aggregation, as text."""
        return f"{self.spec}, bucket {self.bucket}, seed {self.seed}, collective {algorithm}"

    def _field_names(self, algorithm: str) -> tuple[dict[int, str], ...]:
        """Readable names of the signature codes, for error messages (other ranks' options
        are known only by their code)."""
        kinds = [cls for cls in _kinds() if "name" in vars(cls)]
        names = tuple(f"{cls.name}/{a}" for cls in kinds for a in cls.aggregations)
        return ({}, DTYPE_CODES, _codes(OPS), _codes(names), _codes((self._options(algorithm),)))


def float_buffer(buf: Any, what: str) -> FlatBuffer:
    """``buf`` as a :class:`FlatBuffer` of a floating-point dtype, else ArgumentError."""
    flat = as_flat(buf)
    if flat.dtype not in FLOAT_DTYPES:
        raise ArgumentError(f"{what} needs a floating-point buffer, got {flat.dtype}")
    return flat


def _matching(buf: Any, flat: FlatBuffer, what: str) -> FlatBuffer:
    """``buf`` resolved, if it has ``flat``'s length, dtype and kind; else ArgumentError."""
    other = as_flat(buf)
    if (other.size, other.dtype, type(other.data)) != (flat.size, flat.dtype, type(flat.data)):
        raise ArgumentError(f"the {what} ({other.size} {other.dtype}) must match the buffer ({flat.size} {flat.dtype})")
    return other


def _kinds() -> list[type[Compressor]]:
    """Every subclass of :class:`Compressor`, however deep."""
    found, todo = [], Compressor.__subclasses__()
    while todo:
        found.append(todo.pop())
        todo += found[-1].__subclasses__()
    return found


def _codes(names: tuple[str, ...]) -> dict[int, str]:
    """Names by their :func:`collectives.validation.code`."""
    return {validation.code(name): name for name in names}
