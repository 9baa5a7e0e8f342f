"""LSGD: Layered SGD — gradients reduced inside groups, all-reduced among groups behind computation.

Yu, Flynn, Yoo & D'Imperio, "Layered SGD: A Decentralized and Synchronous
SGD Algorithm for Scalable Deep Neural Network Training", arXiv:1906.05936,
2019. Workers are grouped by node
(:func:`collectives.topology.layout.layout`: ``comm.Split_type(COMM_TYPE_SHARED)``,
overridden by ``layout=`` or ``MPIDL_RANKS_PER_NODE`` to emulate nodes); each
group's lowest rank is its representative (the paper's "communicator"). The
group all-reduce is split into its two halves, a reduce to the representative
and a broadcast from it, with the representatives' all-reduce between them
running on a service thread, one step behind.

The scheme (n workers, G groups, step t, g_i(t) the local gradient at the
model x(t); S_g = the sum of g_i over group g; R = the sum over all workers):

1. intra-group reduce (binomial tree, sum) of g_i(t): the representative
   gets S_g(t);
2. the representative waits for the inter-group all-reduce it started at step
   t-1, which now holds R(t-1), starts the inter-group all-reduce (sum) of
   S_g(t) on the service thread — it runs while the workers compute the
   gradient of step t+1 — and broadcasts R(t-1) to its group (binomial tree);
3. every worker sets its gradient to R(t-1) / n, the global average gradient
   of the previous step, and applies the local optimizer.

Staleness: exactly one step. x(t+1) = x(t) - lr d(gbar(t-1)), where
gbar(t-1) was evaluated at x(t-1); the first step only fills the pipeline
(no update), and the inter-group all-reduce in flight at :meth:`LSGD.close`
is never applied. Every worker applies the same gradient, so all models stay
bitwise identical (given identical starting models, ``broadcast_init``): LSGD
is synchronous SGD with a one-step-delayed gradient. The delay shrinks the
learning rates that are stable, and with heavy momentum by far: on a
quadratic with curvature h, SGD with momentum beta is stable for
lr h < 2 (1 + beta), with the delayed gradient only for lr h < 1 - beta (the
roots of z^2 - (1 + beta) z + beta + lr h); for beta = 0.9, 0.1 against 3.8.
Measured: at lr 0.05, momentum 0.9, where AllReduce-SGD trains LeNet-5 on
Fashion-MNIST, LSGD on two groups stays at chance; an MLP on the digits
reaches 78 % where AllReduce-SGD reaches 93 %. Lower the momentum or the
learning rate for LSGD (docs/performance.rst). With a single group
(one node) there is nothing to overlap and LSGD is AllReduce-SGD: one
all-reduce of the fresh gradients, no staleness.

:meth:`~algorithms.base.Algorithm.synchronize` leaves R(t-1)/n in the
gradients, the same on every worker, to be clipped or unscaled before the
update; on the first step they are zero and ``step()`` applies nothing (an
optimizer stepped by the caller applies the zero gradient: no change under
SGD without weight decay). Under a ``GradScaler`` the gradient that step t
unscales was scaled by step t-1's scale, so it is applied times
s(t-1)/s(t): twice the gradient in the step after a backoff, half after a
growth; a step whose delayed gradient overflowed is skipped on every worker.

Cost per step (m bytes, k ranks per group): intra-group reduce and
broadcast, 2 ceil(lg k) (alpha_intra + m beta_intra) + ceil(lg k) m gamma;
among the G representatives one all-reduce of m bytes (ring: 2 m (G-1)/G sent
per representative over inter-node links), off the critical path when the
computation of a step takes longer. Payload sent per step: m by each
non-representative (its reduce message), plus m per child in the broadcast
tree, plus the inter-group all-reduce's on representatives; the in-flight
inter-group all-reduce is counted when it completes (next step, or close).

Checkpoints (:meth:`LSGD.state_dict`): between steps the pipeline holds
the inter-group all-reduce of step t, whose result R(t) the next step
applies. ``state_dict()`` waits for it and the representatives broadcast R(t)
to their groups, so every worker saves it (``delayed_sum``);
``load_state_dict()`` puts it back where step t+1 takes it, and the resumed
run applies the same gradients bit for bit. Under another layout of the same
ranks a resumed run applies R(t) too; with one group (no pipeline) it drops
it and steps with its fresh gradients.

Compression (``compression="NAME[:PARAM]"``, :mod:`algorithms.compressed`)
applies to the inter-group all-reduce among the representatives, the
exchange over the slow links between nodes: step 2 all-reduces (sums)
S_g(t) with the compressor (PowerSGD given the model's matrices), bitwise
identical on every representative, with an error-feedback memory on each
representative (on by default for top-k and PowerSGD;
``error_feedback=``), kept in its state (``residual``, and ``server`` for
the reduce-scatter compressors) for checkpoints, with ``representative``:
a worker that is a representative only under a resumed run's other layout
starts with an empty memory, and a saved representative's state without
its memory is refused. The intra-group reduce and broadcast stay exact;
with one group there is no inter-group exchange and nothing is compressed.

Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
from mpi4py import MPI

import collectives
from collectives import ArgumentError, reduction
from collectives.errors import renamed_keyword
from collectives.kernels.reduce_broadcast import broadcast, reduce
from collectives.topology.hierarchy import node_comms
from collectives.topology.layout import RanksPerNode
from collectives.topology.layout import layout as node_layout
from collectives.transport import gpu, threads
from collectives.transport.background import Background
from collectives.transport.buffers import array_module
from collectives.transport.context import context

from .base import Algorithm
from .compressed import CompressedSlices, resolve


class LSGD(Algorithm):
    """Layered SGD (module docstring for the scheme and its one-step staleness).

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        layout: the groups, as ranks per node: one number (groups of that many
            consecutive ranks) or group sizes such as "3,1"; None detects the
            nodes or reads ``MPIDL_RANKS_PER_NODE``.
        collective: the all-reduce algorithm among the representatives (and of
            the whole gradient when there is one group): a key of
            :data:`collectives.COLLECTIVES`; "auto" is resolved at construction.
        compression: None (or "none"), or a compressor spec "NAME[:PARAM][@AGGREGATION]" of
            :data:`collectives.COMPRESSORS` for the inter-group all-reduce.
        error_feedback: keep the representatives' compression residual for
            their next sum (None: the compressor's default).
        seed: seeds the compressor's random numbers.
        algorithm: the old name of ``collective`` (deprecated).

    Attributes:
        groups: the number of groups; group_size: this worker's group's size;
        representative: whether this worker runs the inter-group all-reduce.
        compression: a representative's compressor and error-feedback memory
            (:class:`~algorithms.compressed.CompressedSlices`), else None.
    """

    name = "lsgd"
    synchronous = True

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        layout: RanksPerNode = None,
        collective: str = collectives.DEFAULT_COLLECTIVE,
        compression: str | None = None,
        error_feedback: bool | None = None,
        seed: int = 0,
        algorithm: str | None = None,
        **common: Any,
    ) -> None:
        self.layout = layout
        self.collective = renamed_keyword(
            "LSGD", "algorithm", "collective", algorithm, collective, collectives.DEFAULT_COLLECTIVE
        )
        self.compression_arg, self.error_feedback_arg, self.seed = compression, error_feedback, seed
        self.compression: CompressedSlices | None = None
        self._background: Background | None = None
        self._delayed = False  # whether the next step applies R(t-1) (the pipeline is full)
        self._applies = True  # whether the step synchronized last applies a gradient
        super().__init__(model, optimizer, comm, **common)

    def _configure(self) -> Hashable:
        if self.collective not in collectives.COLLECTIVES:
            raise ArgumentError(
                f"unknown collective {self.collective!r}; valid collectives: {', '.join(collectives.COLLECTIVES)}"
            )
        threads.require_multiple("LSGD runs the inter-group all-reduce on a service thread")
        if self.layout is not None:
            node_layout(self.comm, self.layout)  # parses the override: local
        self._compression = resolve(self.compression_arg, self.error_feedback_arg, self.flat.layout())
        return (self.layout, self.collective, self._compression, self.seed if self._compression else None)

    def _start(self) -> None:
        lay = node_layout(self.comm, self.layout)  # collective when detecting
        group, leaders = node_comms(context(self.comm), lay)
        self.groups, self.group_size = lay.nodes, group.Get_size()
        self.representative = leaders != MPI.COMM_NULL and self.groups > 1
        if self.groups == 1:
            self._group = group
            self._resolve(group)
            return
        self._intra = context(group).comm  # the tree phases run on its private communicator
        self._red = reduction("avg", self.flat.dtype, array_module(self.flat.grad_data))
        if self.representative:
            # The service thread's own communicator (another instance's thread may use
            # ``leaders`` at the same time); its collectives context is created here, not there.
            self._leaders = leaders.Dup()
            context(self._leaders)
            self._resolve(self._leaders)
            self._inter = (self.flat.new_buffer(), self.flat.new_buffer())
            if self._compression is not None:
                spec, feedback = self._compression
                size, layout = self.flat.size, self.flat.layout()
                self.compression = CompressedSlices(spec, feedback, self.flat.grads, [(0, size)], layout, self.seed)
            self._background = Background(f"lsgd-inter-group-rank{self.rank}", gpu.device_of(self.flat.grad_data))

    def _resolve(self, comm: MPI.Comm) -> None:
        """Make "auto" choose (and calibrate, for the model's memory) now, not inside a
        step, where its time and messages would count as the step's."""
        if self.collective == "auto":
            collectives.explain(self.flat.nbytes, comm, device=self.flat.memory, dtype=self.flat.dtype, op="avg")

    def _step(self) -> None:
        self._synchronize()
        self._update()

    def _synchronize(self) -> None:
        if self.groups == 1:
            with self._communicating():
                collectives.allreduce(self.flat.grads, self._group, "avg", self.collective, validate=False)
            return
        g, apply = self.flat.grad_data, self._delayed
        with self._communicating():
            reduce(g, self._intra, self._red)  # the representative now holds S_g(t)
            if self.representative:
                fresh, last = self._inter[self.iterations % 2], self._inter[1 - self.iterations % 2]
                assert self._background is not None  # made in _start for representatives
                if self._background.pending:
                    self._collect()  # last = R(t-1) (state_dict() may have collected it)
                fresh.data[:] = g
                if self.compression is None:
                    self._background.submit(
                        collectives.allreduce, fresh.owner, self._leaders, "sum", self.collective, validate=False
                    )
                else:
                    self._background.submit(
                        self.compression.allreduce, 0, fresh.owner, self._leaders, "sum", self.collective
                    )
                if apply:
                    g[:] = last.data
            if apply:
                broadcast(g, self._intra)
        self._delayed, self._applies = True, apply
        if apply:
            self._red.finalize(g, self.size)  # R(t-1) / n
        else:
            g.fill(0)  # nothing to apply: an optimizer stepped by the caller sees a zero gradient

    def _update(self) -> None:
        if self._applies:
            self.optimizer.step()

    def _collect(self) -> None:
        """Wait for the in-flight inter-group all-reduce and count its bytes."""
        assert self._background is not None
        _, nbytes = self._background.result()
        self.bytes_sent += nbytes

    def state_dict(self) -> dict[str, Any]:
        """The counters and, once the pipeline is full, ``delayed_sum``: R(t), the
        gradient sum the next step applies (module docstring); a representative's
        error-feedback memory. Collective: the representatives wait for it and
        broadcast it to their groups."""
        if self.groups == 1 or not self._delayed:
            return {**super().state_dict(), **self._memory()}
        held = self._inter[(self.iterations - 1) % 2].data if self.representative else self.flat.new_buffer().data
        if self.representative:
            assert self._background is not None
            if self._background.pending:
                self._collect()
        broadcast(held, self._intra)
        delayed = held.copy() if isinstance(held, np.ndarray) else held.get()
        return {**super().state_dict(), "delayed_sum": delayed, **self._memory()}

    def _memory(self) -> dict[str, Any]:
        """A representative's error-feedback memory (nothing in flight); with compression,
        ``representative``: whether this worker kept one."""
        if self._compression is None:
            return {}
        memory = self.compression.state_dict() if self.compression is not None else {}
        return {"representative": self.representative, **memory}

    def _load_state(self, state: dict[str, Any]) -> None:
        super()._load_state(state)
        if self.compression is not None:
            if state.get("representative", True):
                self.compression.load_state_dict(state)
            else:  # a representative now, under another layout than the saved worker's: no memory yet
                self.compression.reset()
        if self.groups == 1:
            return
        self._delayed = "delayed_sum" in state
        if not self._delayed:
            return
        values, g = state["delayed_sum"], self.flat.grad_data
        if values.shape != g.shape or values.dtype != g.dtype:
            raise ValueError(
                f"delayed_sum has {values.size} elements of {values.dtype}, the model {g.size} of {g.dtype}"
            )
        if self.representative:
            last = self._inter[(self.iterations - 1) % 2].data
            last[...] = array_module(last).asarray(values)

    def close(self) -> None:
        """Wait for the in-flight inter-group all-reduce (its result is dropped), stop the
        thread and free its communicator."""
        if self._background is not None:
            if self._background.pending:
                with self._communicating():
                    self._collect()
            self._background.close()
            self._background = None
            self._leaders.Free()
        super().close()
