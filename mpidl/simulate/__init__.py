"""mpidl simulate: the training algorithms on n simulated workers in one process, in virtual time.

Each simulated worker holds real parameters and computes real gradients on
its own shard (:mod:`~mpidl.simulate.workers`); time is advanced by models
instead of clocks: compute by the paced-step and slowdown models of ``mpidl
train`` (:mod:`mpidl.stepclock`, :mod:`mpidl.slowdowns`), communication by a
flow-level network (:mod:`~mpidl.simulate.network`) driven by an event engine
(:mod:`~mpidl.simulate.engine`). The algorithms' schedules:
:mod:`~mpidl.simulate.allreduce`, :mod:`~mpidl.simulate.adpsgd`,
:mod:`~mpidl.simulate.prague`; the run and its records:
:mod:`~mpidl.simulate.run`; the command: :mod:`~mpidl.simulate.cli`.
"""

from __future__ import annotations

from .engine import Engine
from .network import Links, Network, parse_rate
from .run import SIMULATED, SimConfig, SimResult, simulate

__all__ = ["SIMULATED", "Engine", "Links", "Network", "SimConfig", "SimResult", "parse_rate", "simulate"]
