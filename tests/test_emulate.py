"""The emulated cluster's jobs end whole (``jobs/emulate/cluster.py``'s ``run_job``), checked
without root or namespaces on a local tree of processes shaped like hydra's.

Hydra starts its proxies, and they the ranks, in sessions of their own, so ending
mpiexec's process group does not reach them (nor a process a rank starts in a session of
its own). Here mpiexec's stand-in ignores SIGTERM and starts a child in its process group
and one in a session of its own, both ignoring SIGTERM; when the job runs past its
timeout or is interrupted, none of them may be left. A job that exits and leaves a
process behind has it ended too.
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("emulate_cluster", Path(__file__).parents[1] / "jobs/emulate/cluster.py")
assert _spec is not None and _spec.loader is not None
cluster = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # its dataclass looks itself up there
_spec.loader.exec_module(cluster)

#: A process that ignores SIGTERM and sleeps.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"

#: mpiexec's stand-in: ``python -c TREE PIDS MODE``. MODE "run": it ignores SIGTERM, starts
#: a child in its process group and one in a session of its own, writes its id and theirs
#: to PIDS and sleeps; "exit": it starts the second child, writes the ids and exits.
TREE = f"""
import os, signal, subprocess, sys, time
run = sys.argv[2] == "run"
if run:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
quiet = {{"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}}
stubborn = [sys.executable, "-c", {STUBBORN!r}]
children = [subprocess.Popen(stubborn, start_new_session=True, **quiet)]
if run:
    children.append(subprocess.Popen(stubborn, **quiet))
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(" ".join(str(pid) for pid in [os.getpid(), *(c.pid for c in children)]))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
if run:
    time.sleep(300)
"""


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def job_pids(path: Path, count: int) -> list[int]:
    pids = [int(p) for p in path.read_text().split()]
    assert len(pids) == count, pids
    return pids


@pytest.mark.job
@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["timeout", "interrupt"])
def test_a_job_past_its_timeout_or_interrupted_is_ended_whole(tmp_path: Path, end: str) -> None:
    pids = tmp_path / "pids"
    command = [sys.executable, "-c", TREE, str(pids), "run"]
    if end == "timeout":
        with pytest.raises(subprocess.TimeoutExpired):
            cluster.run_job(command, timeout=4, capture=True)
    else:
        # Ctrl-C, delivered to the main thread as the terminal's reaches cluster.py's only thread
        ctrl_c = threading.Timer(4, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        ctrl_c.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                cluster.run_job(command, capture=True)
        finally:
            ctrl_c.cancel()
    left = [pid for pid in job_pids(pids, 3) if alive(pid)]
    assert not left, f"left running after the job was ended: {left}"


@pytest.mark.timeout(60)
def test_a_job_that_exits_leaving_a_process_has_it_ended(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pids = tmp_path / "pids"
    done = cluster.run_job([sys.executable, "-c", TREE, str(pids), "exit"], capture=True)
    assert done.returncode == 0, done.stderr
    left = [pid for pid in job_pids(pids, 2) if alive(pid)]
    assert not left, f"left running after the job exited: {left}"
    assert "the job exited and left 1 processes running; ended them" in capsys.readouterr().err


def test_a_node_may_have_a_link_of_its_own_rate() -> None:
    """``--node NODE=RATE``: parsed and checked against the cluster's nodes (no root needed)."""
    nodes = ["node1", "node2", "node3"]
    args = argparse.Namespace(rate="1gbit", node=["node3=100mbit"], delay=None)
    rate, node_rates, delay = cluster.link_parameters(args, nodes)
    assert (rate, node_rates, delay) == ("1gbit", {"node3": "100mbit"}, None)
    shaped = cluster.Cluster(nodes=nodes, rate=rate, node_rates=node_rates)
    assert [shaped.bits(n) for n in nodes] == [1e9, 1e9, 1e8]
    assert "node3's 100 Mbit/s" in cluster.describe(shaped)
    for bad, problem in (
        ("node4=100mbit", "--node node4=100mbit: NODE=RATE with NODE one of node1, node2, node3"),
        ("node3", "--node node3: NODE=RATE"),
        ("node3=fast", "rate 'fast'"),
    ):
        with pytest.raises(cluster.ClusterError) as error:
            cluster.link_parameters(argparse.Namespace(rate="1gbit", node=[bad], delay=None), nodes)
        assert problem in str(error.value)
