"""D-PSGD: decentralized parallel SGD over a communication graph.

Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?
A Case Study for Decentralized Parallel Stochastic Gradient Descent",
NeurIPS 2017. With W a symmetric doubly stochastic
mixing matrix over the graph (:mod:`algorithms.topology`), each step on worker i:

1. g_i = grad f_i(x_i), the local gradient at the worker's *current* model
   (computed by the caller before :meth:`~algorithms.base.Algorithm.step`);
2. x_i <- sum_j W_ij x_j: neighbor averaging of the models, in place
   (:func:`collectives.neighbor_allreduce`; the flat parameter buffer is
   sent to every neighbor and the neighbors' buffers are mixed in);
3. x_i <- x_i - lr * d(g_i): the local optimizer's step on the averaged model.

So x_i(t+1) = sum_j W_ij x_j(t) - lr g_i(x_i(t)): averaging and the gradient
use the same x(t). With momentum the direction d is the optimizer's (its
buffer stays local); weight decay, which reads the parameters, sees the
averaged model.

Properties: the mean over workers of x evolves as plain SGD driven by the
mean gradient (1^T W = 1^T), so averaging alone never moves the mean; with
zero learning rate the disagreement ||x_i - mean|| shrinks by |lambda_2(W)|
per step. With a constant learning rate the workers settle within O(lr / gap)
of each other; a decaying one drives them to consensus.

Cost per step on worker i with degree d (m model bytes): alpha + d m beta +
d m gamma, and d m bytes sent (2 m on a ring) — independent of n, where an
all-reduce costs 2 m (n-1)/n per worker but latency growing with n.

Overlap (``overlap=True``; the default for torch models on the CPU where
every rank has a core to spare, :func:`~algorithms.background.spare_cores`):
averaging and gradient both read x(t), so the averaging need not wait for
the gradient. The first forward pass of a step (a forward pre-hook on the
model; passes without gradients, such as evaluations under
``torch.no_grad()``, don't count) starts it on a service thread
(:class:`~collectives.transport.background.Background`, over a private duplicate of the
communicator): x(t) is sent to the neighbors as it is (forward and backward
only read it) and the mix is formed in a separate buffer
(``neighbor_allreduce(..., out=)``) while the caller computes g_i.
``step()`` starts it if no forward pass did, waits for it, mixes the float
buffers (BatchNorm statistics, which the forward pass has just updated) in
place as before, copies the mixed parameters in, and applies the optimizer:
the same operations on the same values as without overlap, so the same
bits. One copy of the model per step is the price; the parameters must not
be changed between the step's first forward pass and ``step()``.
:meth:`DPSGD.settle` waits for a mix in flight and drops it (the next step
mixes again), after which the parameters may be changed (e.g. loaded from a
checkpoint).

Compressed gossip, CHOCO-SGD (``compression="NAME[:PARAM]"``; Koloskova,
Stich & Jaggi, "Decentralized Stochastic Optimization and Gossip Algorithms
with Compressed Communication", ICML 2019, Algorithm 2 in its memory-efficient
form). Worker i keeps, besides its state x_i (parameters and float buffers),
a public copy x^_i of it, which its neighbors rebuild from the same payloads,
and s_i = sum_j W_ij x^_j over its in-neighbors and itself. Each step:

1. x_i <- the local optimizer's step with g_i (computed at x_i);
2. q_i = C((x_i - x^_i) / (1 + omega)) is sent to the neighbors and theirs
   received (omega > 0 for the unbiased compressors of large variance,
   :func:`algorithms.compressed.variance_factor`: random-k's d/k scale
   undone, so that C / (1 + omega) is a contraction as CHOCO needs);
   x^_i += q_i, s_i += W_ii q_i + sum_j W_ij q_j
   (:func:`collectives.neighbor_exchange`);
3. x_i <- x_i + gamma (s_i - x^_i), the consensus step.

Since 1^T W = 1^T, sum_i s_i = sum_i x^_i: the consensus step never moves
the mean of the models (to rounding), and with C the identity and gamma = 1
step 3 is D-PSGD's averaging of the copies. No error feedback: x_i - x^_i
carries what earlier payloads left out. The consensus step size gamma
(:func:`algorithms.compressed.consensus_step`) is 1 for the casts, qsgd
and sign, smaller for top-k, random-k and PowerSGD (measured,
``docs/training.rst``). x^_i and s_i start at
the common initial model when ``broadcast_init`` makes every worker start
there (every worker knows its neighbors' public copies), else at 0, as in
the paper. They are algorithm state (:meth:`DPSGD.state_dict`: ``public``,
``mixed``). Compressed gossip does not overlap (``overlap=True`` is
refused): its payload is encoded from the model after the optimizer step.
Bytes per step: d_out payloads (the compressor's ``payload_nbytes`` of the
state), against d_out m for D-PSGD.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any
from zlib import crc32

import numpy as np
from mpi4py import MPI

from collectives import ArgumentError, Compressor, neighbor_allreduce, neighbor_exchange
from collectives.transport import gpu, threads
from collectives.transport.background import Background
from collectives.transport.context import context

from .background import spare_cores
from .base import Algorithm
from .compressed import gossip, host_copy, load_into, require
from .error_feedback import zeros_like
from .flat import TorchFlatParams
from .topology import Topology, build


class DPSGD(Algorithm):
    """Average models with the graph neighbors, then step the local optimizer.

    Args:
        model, optimizer, comm, broadcast_init, validate: see :class:`~algorithms.base.Algorithm`.
        topology: a :class:`~algorithms.topology.Topology` on ``comm``'s size,
            or the name of one in :data:`algorithms.topology.TOPOLOGIES`
            built for that size.
        weights: "uniform" or "metropolis" mixing weights for a named topology.
        overlap: average the parameters while the gradient is computed (module
            docstring). None: on for torch models on the CPU if every rank has
            a core to spare (:func:`~algorithms.background.spare_cores`), off
            otherwise. True needs a torch model (a forward pass to start from).
        compression: None (or "none"): D-PSGD; a compressor spec "NAME[:PARAM]"
            of :data:`collectives.COMPRESSORS`: CHOCO-SGD's compressed gossip of the
            state (module docstring).
        gamma: CHOCO-SGD's consensus step size in (0, 1] (None: the
            compressor's, :func:`algorithms.compressed.consensus_step`).
        seed: seeds the compressor's random numbers.

    Attributes:
        topology: the resolved topology (every rank holds the whole W).
        overlap: whether the averaging runs during forward and backward.
        compressor: CHOCO-SGD's compressor, or None.
        gamma: CHOCO-SGD's consensus step size, or None.
    """

    name = "dpsgd"
    synchronous = True

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        comm: MPI.Comm | None = None,
        *,
        topology: str | Topology = "ring",
        weights: str = "uniform",
        overlap: bool | None = None,
        compression: str | None = None,
        gamma: float | None = None,
        seed: int = 0,
        **common: Any,
    ) -> None:
        self.topology_arg, self.weights, self.overlap_arg = topology, weights, overlap
        self.compression_arg, self.gamma_arg, self.seed = compression, gamma, seed
        self.compressor: Compressor | None = None
        self.gamma: float | None = None
        self._module = model
        self._background: Background | None = None
        self._hook: Any = None
        self._in_flight = False
        super().__init__(model, optimizer, comm, **common)
        if self.compressor is not None and self.broadcast_init:
            self._public[...] = self.flat.state
            self._mixed[...] = self.flat.state

    def _configure(self) -> Hashable:
        topo = self.topology_arg
        if isinstance(topo, str):
            topo = build(topo, self.size, self.weights)
        elif not isinstance(topo, Topology):
            raise ArgumentError(
                f"topology must be a name or an algorithms.topology.Topology, got {type(topo).__name__}"
            )
        if topo.size != self.size:
            raise ArgumentError(f"topology {topo.name} has {topo.size} ranks, the communicator {self.size}")
        self.topology = topo
        self._row = topo.neighbor_weights(self.rank)
        hooked = isinstance(self.flat, TorchFlatParams)
        if self.overlap_arg and not hooked:
            raise ArgumentError("overlap needs a torch model (its forward pass starts the averaging)")
        if self.overlap_arg:
            threads.require_multiple("overlap averages on a service thread")
        self._may_overlap = hooked and threads.multiple() and type(self.flat.param_data) is np.ndarray
        self._configure_choco()
        return (
            topo.name,
            crc32(topo.W.tobytes()),
            self.overlap_arg,
            self.compressor and self.compressor.spec,
            self.gamma,
        )

    def _configure_choco(self) -> None:
        """Resolve the compressor and gamma of CHOCO-SGD (locally)."""
        choco = gossip(self.compression_arg, self.gamma_arg, self.flat, self.seed)
        if choco is None:
            return
        if self.overlap_arg:
            raise ArgumentError("compressed gossip (CHOCO-SGD) does not overlap: use overlap=False or None")
        self._may_overlap = False
        self.compressor, self.gamma, self._shrink = choco.compressor, choco.gamma, choco.shrink

    def _start(self) -> None:
        if self.compressor is not None:  # x^, s and the difference sent
            self._public, self._mixed, self._delta = (zeros_like(self.flat.state) for _ in range(3))
        arg = self.overlap_arg
        self.overlap = bool(arg) if arg is not None else spare_cores(self.comm, self._may_overlap)
        if not self.overlap:
            return
        # The service thread's own communicator: step() mixes the buffers on self.comm meanwhile.
        self._comm = self.comm.Dup()
        context(self._comm)
        self._mixed = self.flat.new_buffer()
        self._background = Background(f"dpsgd-mix-rank{self.rank}", gpu.device_of(self.flat.param_data))
        self._hook = self._module.register_forward_pre_hook(self._forward_starts)

    def _forward_starts(self, *_: Any) -> None:
        """The forward pre-hook: a forward pass that records gradients leads to a step."""
        import torch

        if torch.is_grad_enabled():
            self._launch()

    def _launch(self) -> None:
        """Start mixing the parameters into the side buffer, unless this step already did."""
        if self._in_flight or self._background is None:
            return
        self._in_flight = True
        self._background.submit(
            neighbor_allreduce, self.flat.params, self._row, self._comm, validate=False, out=self._mixed.owner
        )

    def _collect(self) -> None:
        """Wait for the mix in flight (started if none is) and count its bytes."""
        assert self._background is not None
        self._launch()
        self._in_flight = False
        self.bytes_sent += self._background.result()[1]

    def _step(self) -> None:
        if self.compressor is not None:
            self.optimizer.step()
            with self._communicating():
                self._gossip()
            return
        self._synchronize()
        self.optimizer.step()

    def _synchronize(self) -> None:
        if self.compressor is not None:
            raise NotImplementedError(
                "compressed D-PSGD (CHOCO-SGD) communicates after its optimizer step, not before it; its "
                "gradients are the worker's own: clip or unscale them before step()"
            )
        if self._background is None:
            with self._communicating():
                neighbor_allreduce(self.flat.state, self._row, self.comm, validate=False)
            return
        with self._communicating():
            self._collect()
            if self.flat.has_buffers:
                neighbor_allreduce(self.flat.state_data[self.flat.size :], self._row, self.comm, validate=False)
        self.flat.param_data[...] = self._mixed.data

    def _gossip(self) -> None:
        """CHOCO-SGD's exchange and consensus step (module docstring), in place."""
        x, public, mixed, delta = self.flat.state, self._public, self._mixed, self._delta
        assert self.compressor is not None and self.gamma is not None
        delta[...] = x
        delta -= public
        if self._shrink != 1:
            delta *= self._shrink
        neighbor_exchange(self.compressor, delta, self._row, self.comm, public=public, mixed=mixed, validate=False)
        delta[...] = mixed
        delta -= public
        delta *= self.gamma
        x += delta

    def state_dict(self) -> dict[str, Any]:
        """The counters and, for CHOCO-SGD, ``public`` and ``mixed``: x^_i and s_i."""
        if self.compressor is None:
            return super().state_dict()
        return {**super().state_dict(), "public": host_copy(self._public), "mixed": host_copy(self._mixed)}

    def _load_state(self, state: dict[str, Any]) -> None:
        super()._load_state(state)
        if self.compressor is not None:
            require(state, ("public", "mixed"), "CHOCO-SGD's copies x^ and s; an uncompressed D-PSGD keeps none")
            load_into(self._public, state["public"], "public")
            load_into(self._mixed, state["mixed"], "mixed")

    def settle(self) -> None:
        """Wait for a mix in flight and drop it (module docstring); collective."""
        super().settle()
        self._drop()

    def _drop(self) -> None:
        """Finish and drop the mix in flight on any rank (collective: a rank with none
        in flight starts one, so that every rank's thread takes part)."""
        if self._background is not None and context(self.comm).comm.allreduce(self._in_flight, op=MPI.LOR):
            with self._communicating():
                self._collect()

    def close(self) -> None:
        """Remove the forward hook, drop a mix in flight, stop the thread, free its communicator."""
        if self._background is not None:
            self._hook.remove()
            try:
                self._drop()
            finally:
                self._background.close()
                self._background = None
                self._comm.Free()
        super().close()
