"""Predicted all-reduce times and automatic choice (a pure model; calibration.py measures it).

Model: a message of b bytes over a link costs alpha + b * beta, and reducing b
bytes costs b * gamma. Links inside a node and between nodes have their own
alpha and beta; a step of an algorithm costs what its slowest link costs,
since all its exchanges run in parallel and the next step waits for them.
Each algorithm is written as its steps on the actual node layout (which
exchanges cross nodes), so one set of formulas covers flat, emulated and
real multi-node layouts. With p ranks, n bytes and one link class they reduce
to the textbook forms (Thakur, Rabenseifner & Gropp 2005):

=================== =====================================================================
ring                2(p-1) alpha + 2n (p-1)/p beta + n (p-1)/p gamma
halving_doubling    2 lg p alpha + 2n (p-1)/p beta + n (p-1)/p gamma;  p not a power of
                    two: (2 floor(lg p)+2) alpha + (2(p'-1)/p' + 2) n beta
                    + n (1 + (p'-1)/p') gamma, p' = 2^floor(lg p)
butterfly           lg p (alpha + n beta + n gamma) (+ the fold as above)
reduce_broadcast    2 ceil(lg p) (alpha + n beta) + ceil(lg p) n gamma
hierarchical_ring   intra-node reduce and broadcast + ring among the m leaders
torus2d             2(X-1) alpha + 2n (X-1)/X beta (rows) + ring of n/X bytes on Y (columns)
shm                 b alpha_shm + n beta_shm on one node, s = ceil(n / segment) pieces,
                    b = s barriers (2 ranks or small vectors) or s + 1; across m
                    nodes: that, + ring among the m leaders + s alpha_shm + n beta_shm
                    (broadcast)
=================== =====================================================================

alpha_shm and beta_shm describe the shared-memory algorithm (:mod:`collectives.kernels.shm`):
alpha_shm is one shared-memory barrier with the per-piece work around it,
beta_shm the per-byte cost of copying a vector in, reducing it and copying
the result out, all ranks of a node at once (memory bandwidth is shared).

``overhead`` is the fixed per-call cost of the Python entry point; it is the
same for every algorithm, so it moves predictions but never the choice.
``offset`` corrects each message-passing algorithm by its own measured
latency: alpha is calibrated on one bare exchange step, while an algorithm's
steps carry its own Python around the messages, and a one-way tree step
(send, or receive and combine) costs less than an exchange. That decides the
order at small sizes, so the prediction of an algorithm is its measured time
on 8 bytes plus what the model adds from 8 bytes to n; at large sizes the
offset vanishes against the bandwidth terms. The
cross-rank argument check is not: where it rides along (the shared-memory
algorithm on one node; up to the fused limit across nodes, the butterfly
where each node has one rank, else the shared-memory algorithm, and the
MPI library's all-reduce, in calls that repeat) it
costs nothing, elsewhere one shared-memory barrier (alpha_shm) on one node
or, across m nodes, ceil(lg m) header exchanges, and two shared-memory
barriers where nodes hold several ranks (:func:`check_cost`).

The model is a pure function of the parameters and the layout: nothing here
communicates. The parameters are measured by
:func:`collectives.tuning.calibration.calibrate` (ping-pong exchanges inside
and across nodes, a timed reduction, the shared-memory algorithm timed at two
sizes) and can be saved to and loaded from JSON (:meth:`Params.save`,
:meth:`Params.load`; ``MPIDL_COSTMODEL=FILE`` makes ``collective="auto"`` load
a file instead of measuring).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Callable

from ..kernels import shm as _shm
from ..topology.hierarchy import Grid, default_grid
from ..topology.layout import Layout
from ..validation import FUSE_LIMIT


@dataclass
class Params:
    """Model parameters (seconds, seconds per byte).

    ``offset`` corrects each message-passing algorithm's prediction by name
    (absent names: no correction); see the module docstring.
    """

    alpha_intra: float = 5e-6
    beta_intra: float = 3e-10
    alpha_inter: float = 2e-5
    beta_inter: float = 1e-9
    gamma: float = 1e-10
    overhead: float = 5e-6
    alpha_shm: float = 2e-6
    beta_shm: float = 3e-10
    offset: dict[str, float] = field(default_factory=dict)
    source: str = "built-in defaults"

    def link(self, inter: bool) -> tuple[float, float]:
        """(alpha, beta) of an inter-node or intra-node link."""
        return (self.alpha_inter, self.beta_inter) if inter else (self.alpha_intra, self.beta_intra)

    def save(self, path: str) -> None:
        """Write the parameters to ``path`` as JSON, atomically (:func:`save_json`)."""
        save_json(path, asdict(self))

    @classmethod
    def load(cls, path: str) -> Params:
        """Read parameters written by :meth:`save` (absent fields take their defaults).

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not JSON, or not an object of known parameters of
                the right types (finite numbers; ``offset`` maps algorithm names
                to numbers; ``source`` is text), naming what is wrong.
        """
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"holds a JSON {type(raw).__name__}, not an object of parameters")
        fields = {f.name for f in dataclasses.fields(cls)}
        for key, value in raw.items():
            if key not in fields:
                raise ValueError(f"unknown parameter {key!r} (known: {', '.join(sorted(fields))})")
            if key == "source":
                if not isinstance(value, str):
                    raise ValueError(f"'source' is {value!r}, not text")
            elif key == "offset":
                if not isinstance(value, dict):
                    raise ValueError(f"'offset' is {value!r}, not an object of algorithm names and seconds")
                for name, seconds in value.items():
                    if name not in MODELS:
                        raise ValueError(f"'offset' names {name!r}, not an algorithm ({', '.join(MODELS)})")
                    _number(f"offset {name!r}", seconds)
            else:
                _number(repr(key), value)
        return cls(**raw)

    def __str__(self) -> str:
        return (
            f"alpha_intra={self.alpha_intra * 1e6:.2f}us beta_intra={self.beta_intra * 1e9:.3f}ns/B "
            f"alpha_inter={self.alpha_inter * 1e6:.2f}us beta_inter={self.beta_inter * 1e9:.3f}ns/B "
            f"gamma={self.gamma * 1e9:.3f}ns/B overhead={self.overhead * 1e6:.2f}us "
            f"alpha_shm={self.alpha_shm * 1e6:.2f}us beta_shm={self.beta_shm * 1e9:.3f}ns/B "
            f"offset={{{', '.join(f'{k}: {v * 1e6:+.1f}us' for k, v in self.offset.items())}}} ({self.source})"
        )


def save_json(path: str, obj: object) -> None:
    """Write ``obj`` to ``path`` as JSON, atomically: a reader sees the old file or the
    whole new one (written to a temporary file in the same directory, then renamed
    over ``path``); an interrupted write leaves no temporary file."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _number(what: str, value: object) -> None:
    """Raise ValueError unless ``value`` is a finite number (not a bool, not text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}, not a finite number")


# --- the algorithms as steps ------------------------------------------------


def _crosses(lay: Layout, pairs: Iterable[tuple[int, int]]) -> bool:
    """Whether any (a, b) exchange of a step crosses nodes."""
    return any(lay.node_of[a] != lay.node_of[b] for a, b in pairs)


def _step(prm: Params, lay: Layout, pairs: Iterable[tuple[int, int]], nbytes: float, reduced: float) -> float:
    alpha, beta = prm.link(_crosses(lay, pairs))
    return alpha + nbytes * beta + reduced * prm.gamma


def _ring(prm: Params, lay: Layout, ranks: list[int], n: float) -> float:
    p = len(ranks)
    if p == 1:
        return 0.0
    pairs = [(ranks[i], ranks[(i + 1) % p]) for i in range(p)]
    return (p - 1) * (_step(prm, lay, pairs, n / p, n / p) + _step(prm, lay, pairs, n / p, 0))


def _fold(p: int) -> tuple[int, int, Callable[[int], int]]:
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    return pof2, rem, (lambda i: 2 * i + 1 if i < rem else i + rem)


def _fold_cost(prm: Params, lay: Layout, p: int, n: float) -> float:
    _, rem, _ = _fold(p)
    if not rem:
        return 0.0
    pairs = [(2 * i, 2 * i + 1) for i in range(rem)]
    return _step(prm, lay, pairs, n, n) + _step(prm, lay, pairs, n, 0)


def _xor_pairs(p: int, mask: int) -> list[tuple[int, int]]:
    pof2, _, real = _fold(p)
    return [(real(i), real(i ^ mask)) for i in range(pof2) if i < i ^ mask]


def ring(prm: Params, lay: Layout, n: float, grid: Grid | None = None) -> float:
    """Predicted seconds of the ring algorithm for ``n`` bytes."""
    return _ring(prm, lay, list(range(len(lay.node_of))), n)


def halving_doubling(prm: Params, lay: Layout, n: float, grid: Grid | None = None) -> float:
    """Predicted seconds of recursive halving-doubling for ``n`` bytes."""
    p = len(lay.node_of)
    pof2, _, _ = _fold(p)
    t = _fold_cost(prm, lay, p, n)
    mask = pof2 >> 1
    while mask:
        part = n * mask / pof2
        pairs = _xor_pairs(p, mask)
        t += _step(prm, lay, pairs, part, part) + _step(prm, lay, pairs, part, 0)
        mask >>= 1
    return t


def butterfly(prm: Params, lay: Layout, n: float, grid: Grid | None = None) -> float:
    """Predicted seconds of recursive doubling for ``n`` bytes."""
    p = len(lay.node_of)
    pof2, _, _ = _fold(p)
    t = _fold_cost(prm, lay, p, n)
    mask = 1
    while mask < pof2:
        t += _step(prm, lay, _xor_pairs(p, mask), n, n)
        mask <<= 1
    return t


def _binomial(prm: Params, lay: Layout, ranks: list[int], n: float) -> tuple[float, float]:
    """(reduce, broadcast) seconds of binomial trees over ``ranks`` rooted at ranks[0]."""
    p = len(ranks)
    red = bcast = 0.0
    mask = 1
    while mask < p:
        pairs = [(ranks[r], ranks[r + mask]) for r in range(0, p - mask, 2 * mask)]
        red += _step(prm, lay, pairs, n, n)
        bcast += _step(prm, lay, pairs, n, 0)
        mask <<= 1
    return red, bcast


def reduce_broadcast(prm: Params, lay: Layout, n: float, grid: Grid | None = None) -> float:
    """Predicted seconds of binomial reduce + broadcast for ``n`` bytes."""
    return sum(_binomial(prm, lay, list(range(len(lay.node_of))), n))


def hierarchical_ring(prm: Params, lay: Layout, n: float, grid: Grid | None = None) -> float:
    """Predicted seconds of the hierarchical ring for ``n`` bytes (slowest node)."""
    intra = max(sum(_binomial(prm, lay, list(lay.members(k)), n)) for k in range(lay.nodes))
    return intra + _ring(prm, lay, [lay.members(k)[0] for k in range(lay.nodes)], n)


def torus2d(prm: Params, lay: Layout, n: float, grid: Grid | None = None) -> float:
    """Predicted seconds of the 2D-torus algorithm for ``n`` bytes."""
    x, y = grid or default_grid(lay)
    by_node = set(lay.ranks_per_node) == {x} and (grid is None or tuple(grid) == default_grid(lay))
    rows = (
        [list(lay.members(k)) for k in range(lay.nodes)]
        if by_node
        else [list(range(r * x, r * x + x)) for r in range(y)]
    )
    row_t = max(_ring(prm, lay, row, n) for row in rows)
    col_t = max(_ring(prm, lay, [row[i] for row in rows], n / x) for i in range(x))
    return row_t + col_t


def shm_barriers(q: int, n: float) -> tuple[int, int]:
    """(pieces, barriers) of a shared-memory reduction of ``n`` bytes on ``q`` ranks."""
    pieces = max(1, math.ceil(n / _shm.SEGMENT))
    return pieces, pieces + (0 if q == 2 or n <= _shm.REPLICATE else 1)


def shm(prm: Params, lay: Layout, n: float, grid: Grid | None = None) -> float:
    """Predicted seconds of the shared-memory algorithm for ``n`` bytes (the largest node's)."""
    q = max(lay.ranks_per_node)
    pieces, barriers = shm_barriers(q, n)
    intra = barriers * prm.alpha_shm + n * prm.beta_shm if q > 1 else 0.0
    if lay.nodes == 1:
        return intra
    firsts = [lay.members(k)[0] for k in range(lay.nodes)]
    if n <= _shm.LEADERS_DOUBLING:  # recursive doubling: the leaders' pairs cross between nodes
        leaders = math.ceil(math.log2(lay.nodes)) * _step(prm, lay, [(firsts[0], firsts[1])], n, n)
    else:
        leaders = _ring(prm, lay, firsts, n)
    return leaders + (intra + pieces * prm.alpha_shm + n * prm.beta_shm if intra else 0.0)


#: Predictors by algorithm name: (params, layout, bytes, grid) -> seconds.
MODELS: dict[str, Callable[..., float]] = {
    "ring": ring,
    "halving_doubling": halving_doubling,
    "butterfly": butterfly,
    "reduce_broadcast": reduce_broadcast,
    "hierarchical_ring": hierarchical_ring,
    "torus2d": torus2d,
    "shm": shm,
}


def check_rides(algorithm: str, nbytes: int, lay: Layout) -> bool:
    """Whether the argument check rides along with ``algorithm``'s data (costs nothing
    extra): the shared-memory algorithm on one node; across nodes small vectors of
    the butterfly where every node has one rank, else of the shared-memory
    algorithm (the check goes through the nodes, :mod:`collectives.validation`), and
    of the MPI library's all-reduce (where the call repeats as expected)."""
    if lay.nodes == 1:
        return algorithm == "shm"
    if algorithm == "mpi":
        return nbytes <= FUSE_LIMIT
    return algorithm == ("butterfly" if lay.nodes == len(lay.node_of) else "shm") and nbytes <= FUSE_LIMIT


def check_cost(algorithm: str, nbytes: int, lay: Layout, prm: Params) -> float:
    """Predicted seconds the argument check adds to an all-reduce (see the module docstring)."""
    if check_rides(algorithm, nbytes, lay):
        return 0.0
    if lay.nodes == 1:
        return prm.alpha_shm
    exchanges = math.ceil(math.log2(lay.nodes)) * (prm.alpha_inter + 2 * _shm.HEADER * prm.beta_inter)
    return exchanges if lay.nodes == len(lay.node_of) else exchanges + 2 * prm.alpha_shm


def predict(
    algorithm: str, nbytes: int, lay: Layout, prm: Params, grid: Grid | None = None, validate: bool = False
) -> float:
    """Predicted seconds of one all-reduce of ``nbytes`` with ``algorithm`` (with
    the argument check if ``validate``)."""
    if len(lay.node_of) == 1:
        return prm.overhead
    check = check_cost(algorithm, nbytes, lay, prm) if validate else 0.0
    return prm.overhead + check + prm.offset.get(algorithm, 0.0) + MODELS[algorithm](prm, lay, float(nbytes), grid)


@dataclass
class Choice:
    """What ``collective="auto"`` picks for a size, and why.

    ``predictions`` are every candidate's predicted or measured seconds, least
    first; ``source`` says where they come from: "model" (this module),
    "calibration" or "online tuning" (:mod:`collectives.tuning.table`), "cached
    ..." where the persisted cache held them, "watch" where the choice's rival
    took its place on the program's calls (:mod:`collectives.tuning.watch`)."""

    algorithm: str
    nbytes: int
    predictions: dict[str, float] = field(default_factory=dict)
    reason: str = ""
    source: str = "model"

    def __str__(self) -> str:
        return self.reason


def choose(
    nbytes: int,
    lay: Layout,
    prm: Params,
    grid: Grid | None = None,
    candidates: Iterable[str] = MODELS,
    validate: bool = False,
) -> Choice:
    """The algorithm among ``candidates`` with the least predicted time for ``nbytes``
    on ``lay`` (with the argument check if ``validate``)."""
    preds = {name: predict(name, nbytes, lay, prm, grid, validate) for name in candidates}
    ranked = sorted(preds, key=lambda k: (preds[k], k))
    best = ranked[0]
    runner = f", next {ranked[1]} {preds[ranked[1]] * 1e6:.1f} us" if len(ranked) > 1 else ""
    checked = "checked" if validate else "unchecked"
    reason = (
        f"auto: {best} for {nbytes} B on {len(lay.node_of)} ranks ({lay}), {checked}: predicted "
        f"{preds[best] * 1e6:.1f} us, the least of {len(preds)}{runner}; {prm}"
    )
    return Choice(best, nbytes, {k: preds[k] for k in ranked}, reason)


def model_bound(nbytes: int, p: int, beta: float) -> float:
    """The bandwidth lower bound 2 (p-1)/p * nbytes * beta (Patarasuk & Yuan 2009)."""
    return 2 * (p - 1) / p * nbytes * beta if p > 1 else 0.0
