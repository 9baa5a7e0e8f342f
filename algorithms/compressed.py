"""Compression inside the training algorithms: which compressor, on which slices, with what memory.

The compressors (:mod:`collectives.compression`) know nothing of training.
This module builds them for an algorithm's buffers and owns what persists
between steps:

* :func:`resolve` checks a spec "NAME[:PARAM][@AGGREGATION]" and the error-feedback switch
  locally, at construction; ``none`` and None mean no compression (the
  algorithm's uncompressed path, unchanged);
* :func:`compressor_for` makes the compressor for a buffer of a given layout:
  the (offset, shape) of each parameter inside the buffer
  (:meth:`algorithms.flat.FlatParams.layout`) goes to the compressors that
  take it: PowerSGD compresses the matrix-shaped parameters, top-k keeps
  its ratio of every parameter, sign's scales lie inside parameters; the
  others need nothing;
* :class:`CompressedSlices` aggregates slices of one flat buffer
  (AllReduce-SGD's buckets, LSGD's whole gradient sum) with a compressor and
  an :class:`~algorithms.error_feedback.ErrorFeedback` memory per slice, and
  hands the memory to checkpoints.

Error feedback is on by default for top-k and PowerSGD
(:attr:`~collectives.compression.Compressor.feedback`), where the literature
uses it and it trained best here, and off for the others, sign included (it
trained better without: :mod:`collectives.compression.sign`);
``error_feedback=True`` or ``False`` overrides the default.

Seeds: each slice's compressor is seeded from (seed, slice index), so that
stochastic compressors draw independently per slice, alike on every rank
where the draw is shared (random-k's indices, PowerSGD's first Q).

Checkpoints: the error-feedback memory is algorithm state
(:meth:`CompressedSlices.state_dict`); the compressors' own state
(PowerSGD's warm-start Q, the random generators of qsgd and random-k) is
not: a restored run draws it afresh, alike on every rank, so the workers stay
consistent, but those compressors do not send the bits the uninterrupted run
would have sent (none, fp16, bf16, sign and top-k are deterministic: a
restored run takes the same steps bit for bit).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

import collectives
from collectives import COMPRESSORS, ArgumentError, Compressor, as_flat
from collectives.compression import QSGD, PowerSGD, RandomK, TopK
from collectives.transport.buffers import array_module

from .error_feedback import ErrorFeedback

#: A layout: (offset, shape) of every parameter inside a buffer, in order.
Layout = Sequence[tuple[int, Sequence[int]]]


def resolve(spec: Any, error_feedback: Any, layout: Layout) -> tuple[str, bool] | None:
    """The compression an algorithm was given, checked locally: (the compressor's
    canonical spec, whether error feedback is on), or None for no compression.

    Args:
        spec: None, or a compressor spec "NAME[:PARAM]" (:data:`collectives.COMPRESSORS`);
            "none" is no compression.
        error_feedback: None (the compressor's default), True or False.
        layout: the layout of the buffer the compressor will see (for PowerSGD).

    Raises:
        ArgumentError: a bad spec or option, or error feedback without a compressor.
    """
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ArgumentError(f"error_feedback must be None, True or False, got {error_feedback!r}")
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "none"):
        if error_feedback:
            raise ArgumentError("error_feedback needs a compression (it keeps what the compressor dropped)")
        return None
    if not isinstance(spec, str):
        raise ArgumentError(
            f"compression must be a spec NAME[:PARAM] of {', '.join(COMPRESSORS)}, got {type(spec).__name__}"
        )
    probe = compressor_for(spec, layout)
    return probe.spec, probe.feedback if error_feedback is None else error_feedback


#: CHOCO-SGD's consensus step size by compressor, where it does not depend on the
#: parameter (measured: docs/training.rst); top-k, random-k and PowerSGD: :func:`consensus_step`.
GAMMA = {"none": 1.0, "fp16": 1.0, "bf16": 1.0, "qsgd": 1.0, "sign": 1.0}


def consensus_step(compressor: Compressor, gamma: Any = None) -> float:
    """CHOCO-SGD's consensus step size: ``gamma``, checked, or the compressor's default:
    :data:`GAMMA`; top-k 2 ratio; random-k ratio / 2; PowerSGD r / the largest
    min(rows, cols) of its matrices (the fraction of a random matrix that rank r keeps),
    at most 1. These drew four models on a ring together fastest at lr 0, among
    consensus step sizes from 0.008 to 1 (docs/training.rst).

    Raises:
        ArgumentError: a gamma outside (0, 1].
    """
    if gamma is None:
        if isinstance(compressor, TopK):
            return min(1.0, 2 * compressor.ratio)
        if isinstance(compressor, RandomK):
            return min(1.0, compressor.ratio / 2)
        if isinstance(compressor, PowerSGD):
            widest = max((min(rows, cols) for _, rows, cols in compressor.layers), default=1)
            return min(1.0, compressor.rank / widest)
        return GAMMA.get(compressor.name, 1.0)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
        raise ArgumentError(f"gamma, CHOCO-SGD's consensus step size, must be in (0, 1], got {gamma!r}")
    return float(gamma)


def variance_factor(compressor: Compressor, length: int) -> float:
    """omega of an unbiased compressor on ``length`` elements, E||C(x) - x||^2 <= omega ||x||^2
    (random-k: d/k - 1; qsgd: min(b / s^2, sqrt(b) / s) per bucket of b); 0 for the others.
    C / (1 + omega) is then a contraction, as CHOCO-SGD needs (Koloskova et al. 2019,
    section 3)."""
    if isinstance(compressor, RandomK):
        return length / compressor.k(length) - 1 if length else 0.0
    if isinstance(compressor, QSGD):
        return min(compressor.bucket / compressor.levels**2, compressor.bucket**0.5 / compressor.levels)
    return 0.0


class Gossip(NamedTuple):
    """CHOCO-SGD's compressed gossip as :func:`gossip` resolves it."""

    compressor: Compressor
    layout: Layout
    gamma: float
    shrink: float


def state_layout(flat: Any) -> Layout:
    """The layout of a :class:`~algorithms.flat.FlatParams`'s state: its parameters, then
    its float buffers (if any) as one flat entry."""
    layout: list[tuple[int, Sequence[int]]] = list(flat.layout())
    if flat.has_buffers:
        layout.append((flat.size, (flat.state_data.shape[0] - flat.size,)))
    return layout


def gossip(spec: Any, gamma: Any, flat: Any, seed: int = 0) -> Gossip | None:
    """CHOCO-SGD's compressor (for the state of ``flat``, seeded with ``seed``), the state's
    layout, the consensus step size (:func:`consensus_step`) and the shrink factor
    1 / (1 + omega) (:func:`variance_factor`), checked locally; None for no compression.

    Raises:
        ArgumentError: a bad spec, an aggregation in it (gossip sends the payloads
            themselves), or a bad gamma, or a gamma without a compression.
    """
    layout = state_layout(flat)
    resolved = resolve(spec, None, layout)
    if resolved is None:
        if gamma is not None:
            raise ArgumentError("gamma is CHOCO-SGD's consensus step size: it needs a compression")
        return None
    if "@" in resolved[0]:
        raise ArgumentError(
            f"compression {resolved[0]!r}: CHOCO-SGD sends each neighbor the payload itself, "
            "nothing is aggregated: leave the aggregation out"
        )
    compressor = compressor_for(resolved[0], layout, seed)
    length = flat.state_data.shape[0]
    return Gossip(compressor, layout, consensus_step(compressor, gamma), 1 / (1 + variance_factor(compressor, length)))


def compressor_for(spec: str, layout: Layout, seed: int = 0) -> Compressor:
    """The compressor ``spec`` names for a buffer laid out as ``layout`` (given to the
    compressors that take ``shapes``: PowerSGD, top-k, sign), seeded with ``seed``.

    Raises:
        ArgumentError: a bad spec or option.
    """
    kind = COMPRESSORS.get(name_of(spec))
    options: dict[str, Any] = {"seed": seed}
    if kind is not None and "shapes" in inspect.signature(kind).parameters:
        options["shapes"] = layout
    return collectives.compressor(spec, **options)


def name_of(spec: str) -> str:
    """The compressor's name in a spec "NAME[:PARAM][@AGGREGATION]", lower case."""
    return spec.partition("@")[0].partition(":")[0].strip().lower()


def part(layout: Layout, start: int, stop: int) -> list[tuple[int, Sequence[int]]]:
    """The entries of ``layout`` inside ``[start, stop)``, with offsets from ``start``."""
    return [(offset - start, shape) for offset, shape in layout if start <= offset < stop]


def slice_seed(seed: int, index: int) -> int:
    """The seed of slice ``index``'s compressor (module docstring)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


class CompressedSlices:
    """Compressed aggregation of slices of one flat buffer, each with its compressor and
    its error-feedback memory (module docstring).

    Args:
        spec, error_feedback: as :func:`resolve` returns them.
        like: the flat buffer (numpy, torch, CuPy; 1-D) whose slices are aggregated;
            the memory takes its kind and dtype.
        bounds: the slices, (start, stop) each; they must not overlap.
        layout: the buffer's layout (:meth:`algorithms.flat.FlatParams.layout`).
        seed: seeds the compressors.

    Attributes:
        spec: the compressor spec.
        error_feedback: whether each slice keeps a memory.
        layouts: per slice, the layout of the parameters in it (offsets from its start).
        feedback: per slice, its compressor and memory (:class:`ErrorFeedback`).
    """

    def __init__(
        self,
        spec: str,
        error_feedback: bool,
        like: Any,
        bounds: Sequence[tuple[int, int]],
        layout: Layout,
        seed: int = 0,
    ) -> None:
        self.spec, self.error_feedback = spec, error_feedback
        self.bounds = tuple((int(a), int(b)) for a, b in bounds)
        self.length = int(like.shape[0])
        self.layouts = [part(layout, a, b) for a, b in self.bounds]
        self.feedback = [
            ErrorFeedback(compressor_for(spec, shapes, slice_seed(seed, k)), like[a:b], enabled=error_feedback)
            for k, ((a, b), shapes) in enumerate(zip(self.bounds, self.layouts))
        ]

    def allreduce(self, k: int, buf: Any, comm: MPI.Comm, op: str, collective: str) -> Any:
        """Aggregate ``buf``, slice ``k`` of the buffer (or a buffer like it), compressed
        with error feedback, in place: ``buf`` ends bitwise identical on all ranks of
        ``comm`` (:meth:`ErrorFeedback.allreduce`); ``algorithm`` is the all-reduce of
        the linear compressors."""
        return self.feedback[k].allreduce(buf, comm, op, collective=collective)

    def respec(self, k: int, spec: str) -> None:
        """Compress slice ``k`` from now on with the compressor ``spec`` names (for the
        slice's layout, seeded as before), keeping its memory; nothing if it has it."""
        f = self.feedback[k]
        if f.compressor.spec != spec:
            f.compressor = compressor_for(spec, self.layouts[k], f.compressor.seed)

    def reset(self) -> None:
        """Forget every slice's memory."""
        for f in self.feedback:
            f.reset()

    def state_dict(self) -> dict[str, np.ndarray]:
        """The memories, each as one host array of the buffer's length (zero outside
        the slices): ``residual`` and, for the reduce-scatter compressors, ``server``
        (:class:`ErrorFeedback`); nothing without error feedback."""
        state = {}
        for key in self._memories():
            parts = [host_copy(getattr(f, key)) for f in self.feedback]
            state[key] = np.zeros(self.length, parts[0].dtype)
            for (a, b), values in zip(self.bounds, parts):
                state[key][a:b] = values
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the memories from ``state`` (:meth:`state_dict`).

        Raises:
            ValueError: a memory missing, or of another length or dtype.
        """
        require(state, self._memories(), "the error-feedback memory")
        for key in self._memories():
            values = state[key]
            if values.shape != (self.length,):
                raise ValueError(f"the error-feedback {key} has {values.size} elements, the buffer {self.length}")
            for (a, b), f in zip(self.bounds, self.feedback):
                load_into(getattr(f, key), values[a:b], f"the error-feedback {key}")

    def _memories(self) -> list[str]:
        """The attributes of :class:`ErrorFeedback` that hold memory here."""
        if not self.feedback:
            return []
        return [key for key in ("residual", "server") if getattr(self.feedback[0], key) is not None]


def host_copy(buf: Any) -> np.ndarray:
    """A host copy of the flat buffer ``buf`` (numpy, torch, CuPy; bfloat16 as its bits)."""
    data = as_flat(buf).data
    return data.copy() if isinstance(data, np.ndarray) else data.get()


def require(state: dict[str, Any], keys: Sequence[str], what: str) -> None:
    """Raise ValueError if ``state`` lacks any of ``keys``, which hold ``what``."""
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"the state lacks {', '.join(map(repr, missing))} ({what})")


def load_into(buf: Any, values: np.ndarray, what: str) -> None:
    """Set the flat buffer ``buf`` to ``values``, a :func:`host_copy` of a buffer like it.

    Raises:
        ValueError: ``values`` of another length or dtype (``what`` names them).
    """
    data = as_flat(buf).data
    if values.shape != data.shape or values.dtype != data.dtype:
        raise ValueError(f"{what} has {values.size} elements of {values.dtype}, the model {data.size} of {data.dtype}")
    data[...] = array_module(data).asarray(values)
