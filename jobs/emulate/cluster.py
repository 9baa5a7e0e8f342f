#!/usr/bin/env python3
"""An emulated cluster on one machine: nodes as network namespaces, links shaped with tc.

    jobs/emulate/cluster.py up --nodes 2 --rate 1gbit      # make it, then check it
    jobs/emulate/cluster.py run -n 2 -- mpidl info         # an MPI job, 2 ranks per node
    jobs/emulate/cluster.py run --timeout 600 -n 2 -- ...  # ended, all of it, after 10 min
    jobs/emulate/cluster.py shape --rate 100mbit           # another link rate, then check
    jobs/emulate/cluster.py shape --rate 1gbit --node node3=100mbit   # one node's link slower
    jobs/emulate/cluster.py check                          # measure the links again
    jobs/emulate/cluster.py status                         # what exists
    jobs/emulate/cluster.py down                           # remove all that up made

Layout. Node i is the network namespace ``node<i>`` with one interface,
``eth0``, address ``10.250.0.<i>/24``, and ``/etc/netns/node<i>/hosts`` (which
``ip netns exec`` shows as its ``/etc/hosts``) naming every node and
``headnode``. Its link is a veth pair: ``eth0`` in the node, ``veth-node<i>``
in the root namespace, plugged into the bridge ``mpidlbr0`` (address
``10.250.0.254``, where mpiexec runs). The namespaces get no default route and
forwarding is left alone: nothing leaves the machine.

Shaping. A node's link is full duplex at ``--rate``: a token bucket (tc
``tbf``) on the node's egress (``eth0``) and one on its ingress (the egress of
``veth-node<i>`` toward the node). A message from node 1 to node 2 passes
node 1's egress bucket and node 2's ingress bucket. ``--node NODE=RATE``
gives one node's link its own rate (a slow link: a node behind a slower
switch port, or one whose link other jobs share), both ways. ``--delay`` adds a one-way
delay on each node's egress with ``netem``, where the kernel has it
(``sch_netem``); where it does not, ``up`` and ``shape`` refuse with that
reason.

Launch. ``run`` starts MPICH's hydra (the ``mpiexec`` of the ``mpich`` wheel,
first on PATH) with ``-launcher ssh -launcher-exec launch.sh`` (this folder),
which runs each node's proxy in the node's namespace with hostname ``node<i>``,
so MPI sees one host per node. Between nodes MPICH would still use shared
memory (the same kernel) unless told otherwise: ``--netmod ofi-tcp`` (the
default) sends inter-node messages over TCP through the links. The
environment (PATH, PYTHONPATH, MPIDL_*) reaches every rank.

A job leaves nothing behind. Hydra starts each proxy, and each proxy each
rank, in a session of its own, so ending mpiexec's process group (as
``timeout`` does) does not reach them, nor a process a rank started in a
session of its own. mpiexec runs in a session of its own, with a tag of the
job in its environment (``MPIDL_EMULATE_JOB``) that hydra hands to the
proxies and ranks and they to what they start; when the job exits, runs past
``run --timeout`` or is interrupted (Ctrl-C, SIGTERM), every process with
the tag, on every node, is ended (SIGTERM, SIGKILL after 3 s), so that
nothing of it runs on into the next job.

Check. ``up``, ``shape`` and ``check`` run a 4 MiB MPI ping-pong between the
nodes in pairs (node1-node2, node3-node4, ...; one rank each, over the same
launch as ``run``) and read the byte counters of each node's veth before and
after: every node's link must have carried at least the bytes the ping-pong
sent each way, MPI must see one node per namespace, and a shaped rate must be
met within 15 %. A failed ``up`` removes what it made.

State. ``up`` records each thing it makes, just before it makes it, in
``/run/mpidl-emulate.json``; ``down`` undoes exactly those, in reverse order,
checks that none is left and only then deletes the record. A second ``up``
while one exists is refused. Needs root, iproute2 (``ip``, ``tc``) and
util-linux (``unshare``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "launch.sh"
PINGPONG = HERE / "pingpong.py"
STATE = Path("/run/mpidl-emulate.json")
LOCK = Path("/run/mpidl-emulate.lock")
BRIDGE = "mpidlbr0"
NODE_PREFIX = "node"
SUBNET = "10.250.0.0/24"
HEAD_NAME = "headnode"

#: How messages between nodes travel: the environment that makes MPICH use the links.
NETMODS = {
    "ofi-tcp": {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"},
    "ucx-tcp": {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0"},
    "default": {},  # MPICH's choice: shared memory between namespaces, the links unused
}

#: The environment variable that marks a job's processes (the module docstring), and the
#: seconds they get between SIGTERM and SIGKILL when the job is ended.
JOB_TAG = "MPIDL_EMULATE_JOB"
END_GRACE_S = 3.0

#: The check's message size and how close a shaped link must come to its rate.
CHECK_BYTES = 4 << 20
CHECK_TOLERANCE = 0.15

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_DELAY = re.compile(r"^\d+(?:\.\d+)?(?:us|ms|s)$")


class ClusterError(Exception):
    """Something the cluster cannot do, with the reason; the command exits with 1."""


# --- running tools ---------------------------------------------------------------------------


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command, output captured; a failure raises ClusterError with its stderr."""
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise ClusterError(f"'{' '.join(args)}' failed ({done.returncode}): {done.stderr.strip()}")
    return done


def require_root_and_tools() -> None:
    """Stop with a clear message unless this runs as root with ip, tc and unshare."""
    if os.geteuid() != 0:
        raise ClusterError("needs root (network namespaces, tc): run it with sudo or as root")
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(
            f"missing {', '.join(missing)}: install iproute2 (ip, tc) and util-linux (unshare), "
            "e.g. apt-get install iproute2"
        )


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Hold the cluster's lock: one up, shape or down at a time."""
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# --- link parameters -------------------------------------------------------------------------


def parse_rate(text: str | None) -> float | None:
    """Bits per second from tc-style ``100mbit``, ``1gbit``, ...; None for ``unshaped``."""
    if text is None or text in ("unshaped", "none"):
        return None
    match = _RATE.match(text.strip().lower())
    if not match or float(match[1]) <= 0:
        raise ClusterError(f"rate '{text}': bits per second as tc writes them (100mbit, 1gbit, 10gbit), or unshaped")
    return float(match[1]) * _RATE_UNITS[match[2]]


def parse_delay(text: str | None) -> str | None:
    """A one-way delay as netem takes it (``100us``, ``2ms``); None for none."""
    if text is None or text in ("0", "none"):
        return None
    if not _DELAY.match(text):
        raise ClusterError(f"delay '{text}': give it as 100us, 2ms or 0.5s")
    return text


def describe_rate(bits: float | None) -> str:
    """``1 Gbit/s`` for 1e9, ``unshaped`` for None."""
    if bits is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g} {unit}"
    return f"{bits:.4g} bit/s"


def tbf(bits: float) -> list[str]:
    """The tc arguments of a token bucket at ``bits`` per second.

    The bucket (what passes at once, unpaced) holds 128 KiB, or 100 us of the
    rate above 10 Gbit/s: a whole TSO segment (64 KiB) passes unsplit, the
    queue is woken at most every 100 us, and a 4 MiB message gains at most 3 %
    from a bucket that filled while the link was idle (1 ms of the rate let the
    check see 12.4 Gbit/s on a 10 Gbit/s link). The queue holds 5 ms of the rate
    more, enough for TCP to keep the link busy: with a 64 KiB bucket and 70 KB
    of queue, 16 MiB took three times as long at 1 Gbit/s.
    """
    rate = bits / 8
    burst = max(128 << 10, math.ceil(rate * 100e-6))
    limit = burst + math.ceil(rate * 5e-3)
    return ["tbf", "rate", f"{bits:.0f}bit", "burst", str(burst), "limit", str(limit)]


def netem_available() -> bool:
    """Whether this kernel has ``sch_netem``: tried in a throwaway network namespace."""
    probe = ("unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    return sh(*probe, check=False).returncode == 0


def shape_device(device: str, bits: float | None, delay: str | None, netns: str | None = None) -> None:
    """Make the root qdisc of ``device`` netem (delay) over tbf (rate), either one, or none."""
    tc = ["tc", "-n", netns] if netns else ["tc"]
    shown = sh(*tc, "qdisc", "show", "dev", device, "root").stdout.split()
    if shown[1:2] in (["tbf"], ["netem"]):  # ours; a veth starts with noqueue, which cannot be deleted
        sh(*tc, "qdisc", "del", "dev", device, "root")
    if delay:
        sh(*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem", "delay", delay, "limit", "100000")
        if bits is not None:
            sh(*tc, "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", *tbf(bits))
    elif bits is not None:
        sh(*tc, "qdisc", "add", "dev", device, "root", *tbf(bits))


# --- what up made ----------------------------------------------------------------------------


@dataclass
class Cluster:
    """The cluster as recorded in STATE: its shape and each thing made, in order."""

    nodes: list[str]
    rate: str | None = None  # as given, e.g. "1gbit"; None: unshaped
    node_rates: dict[str, str] = field(default_factory=dict)  # nodes whose link has its own rate
    delay: str | None = None
    made: list[list[str]] = field(default_factory=list)  # [kind, name]: link, netns, dir, file
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))

    @classmethod
    def load(cls) -> Cluster | None:
        """The recorded cluster, or None when there is none."""
        try:
            return cls(**json.loads(STATE.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as error:
            raise ClusterError(f"{STATE} is unreadable ({error}): remove what it lists by hand, then it") from None

    def save(self) -> None:
        """Write the record (atomically: a crash leaves the old one or the new one)."""
        partial = STATE.with_suffix(".tmp")
        partial.write_text(json.dumps(asdict(self), indent=1) + "\n")
        partial.replace(STATE)

    def record(self, kind: str, name: str) -> None:
        """Note, on disk, that ``name`` (a ``kind``) is made next, so that down finds it."""
        self.made.append([kind, name])
        self.save()

    def address(self, node: str) -> str:
        """The node's address on the bridge: the i-th address of the subnet for node i."""
        return str(ipaddress.ip_network(SUBNET)[self.nodes.index(node) + 1])

    @property
    def head_address(self) -> str:
        """The bridge's address in the root namespace, where mpiexec runs."""
        return str(ipaddress.ip_network(SUBNET)[-2])

    @staticmethod
    def veth(node: str) -> str:
        """The root-namespace end of the node's link, a port of the bridge."""
        return f"veth-{node}"

    def bits(self, node: str) -> float | None:
        """The rate of the node's link in bits per second (None: unshaped)."""
        return parse_rate(self.node_rates.get(node, self.rate))


def exists(kind: str, name: str) -> bool:
    """Whether the thing ``up`` made (or would make) is there."""
    if kind == "link":
        return Path("/sys/class/net", name).exists()
    if kind == "netns":
        return Path("/run/netns", name).exists()
    return Path(name).exists()


def hosts_file(cluster: Cluster) -> str:
    """``/etc/hosts`` as the nodes see it: every node, and the root namespace as headnode."""
    own = os.uname().nodename.split(".")[0]
    head = [HEAD_NAME] + ([own] if own not in cluster.nodes and own != HEAD_NAME else [])
    lines = ["# made by jobs/emulate/cluster.py up, removed by its down", "127.0.0.1 localhost"]
    lines.append(f"{cluster.head_address} {' '.join(head)}")
    lines += [f"{cluster.address(node)} {node}" for node in cluster.nodes]
    return "\n".join(lines) + "\n"


def build(cluster: Cluster) -> None:
    """Make the bridge, then each node: namespace, veth pair, addresses, hosts file.

    Each thing is recorded just before it is made, so that a crash at any point
    leaves nothing that down does not know (down skips what is not there).
    """
    prefix = ipaddress.ip_network(SUBNET).prefixlen
    cluster.record("link", BRIDGE)
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{cluster.head_address}/{prefix}", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    etc = Path("/etc/netns")
    if not etc.exists():
        cluster.record("dir", str(etc))
        etc.mkdir()
    for node in cluster.nodes:
        cluster.record("netns", node)
        sh("ip", "netns", "add", node)
        cluster.record("link", cluster.veth(node))
        sh("ip", "link", "add", cluster.veth(node), "type", "veth", "peer", "name", "eth0", "netns", node)
        sh("ip", "link", "set", cluster.veth(node), "master", BRIDGE, "up")
        sh("ip", "-n", node, "link", "set", "lo", "up")
        sh("ip", "-n", node, "addr", "add", f"{cluster.address(node)}/{prefix}", "dev", "eth0")
        sh("ip", "-n", node, "link", "set", "eth0", "up")
        cluster.record("dir", str(etc / node))
        (etc / node).mkdir()
        cluster.record("file", str(etc / node / "hosts"))
        (etc / node / "hosts").write_text(hosts_file(cluster))


def shape(cluster: Cluster) -> None:
    """Shape every node's link both ways at its rate; the delay goes on the node's egress only."""
    for node in cluster.nodes:
        shape_device("eth0", cluster.bits(node), cluster.delay, netns=node)
        shape_device(cluster.veth(node), cluster.bits(node), None)


def stop_processes(node: str) -> list[int]:
    """End the processes left in the node's namespace (TERM, then KILL after 5 s); their ids."""
    pids = [int(pid) for pid in sh("ip", "netns", "pids", node, check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        for _ in range(50):
            if not any(Path(f"/proc/{pid}").exists() for pid in pids):
                return pids
            time.sleep(0.1)
    return pids


def teardown(cluster: Cluster) -> list[str]:
    """Undo what the record lists, newest first, and check it is gone; notes on what was kept.

    A directory that holds entries not made here stays (noted). Anything else
    still there raises ClusterError and stays in the record, for another down.
    """
    notes = []
    for kind, name in cluster.made:
        if kind == "netns" and exists(kind, name):
            pids = stop_processes(name)
            if pids:
                notes.append(f"stopped processes left in {name}: {' '.join(map(str, pids))}")
    kept = []
    for kind, name in reversed(cluster.made):
        if not exists(kind, name):
            continue
        if kind == "link":
            sh("ip", "link", "del", name, check=False)
        elif kind == "netns":
            sh("ip", "netns", "del", name, check=False)
        elif kind == "file":
            Path(name).unlink(missing_ok=True)
        elif kind == "dir":
            try:
                Path(name).rmdir()
            except OSError:
                notes.append(f"kept {name}: it holds entries not made here")
                kept.append([kind, name])
    left = [item for item in cluster.made if item not in kept and exists(*item)]
    if left:
        cluster.made = left
        cluster.save()
        raise ClusterError(f"still there after down: {', '.join(' '.join(item) for item in left)}")
    STATE.unlink(missing_ok=True)
    return notes


# --- launching on the nodes ------------------------------------------------------------------


def mpiexec_command(cluster: Cluster, nodes: list[str], per_node: int, netmod: str) -> list[str]:
    """Hydra's command line for ``per_node`` ranks on each of ``nodes``, before the program."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise ClusterError("no mpiexec on PATH: activate the virtualenv that has the mpich wheel (pip install mpich)")
    if "HYDRA" not in sh(mpiexec, "--version", check=False).stdout:
        raise ClusterError(f"{mpiexec} is not MPICH's hydra, which run needs (the mpich wheel's mpiexec)")
    command = [mpiexec, "-launcher", "ssh", "-launcher-exec", str(LAUNCHER), "-localhost", cluster.head_address]
    command += ["-hosts", ",".join(f"{node}:{per_node}" for node in nodes), "-n", str(per_node * len(nodes))]
    for name, value in NETMODS[netmod].items():
        command += ["-genv", name, value]
    return command


def run_job(
    command: list[str], timeout: float | None = None, capture: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the MPI job ``command`` (mpiexec and its arguments) to its end; nothing of it is left.

    mpiexec runs in a session of its own, with a new tag in JOB_TAG. When it exits, runs
    past ``timeout`` seconds (subprocess.TimeoutExpired) or this process is interrupted
    (KeyboardInterrupt; SIGTERM, which main makes SystemExit), the job is ended
    (:func:`end_job`) before this returns or raises; a job that exited but left processes
    running is told on stderr. Output goes to this process's, or is captured (``capture``).
    """
    tag = uuid.uuid4().hex
    pipe = subprocess.PIPE if capture else None
    env = {**os.environ, JOB_TAG: tag}
    with subprocess.Popen(command, env=env, start_new_session=True, stdout=pipe, stderr=pipe, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            left = end_job(proc, tag)
    if left:
        print(f"cluster.py: the job exited and left {len(left)} processes running; ended them", file=sys.stderr)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def job_processes(tag: str) -> list[int]:
    """The live processes whose environment carries JOB_TAG=``tag``: mpiexec, the launchers,
    hydra's proxies and the ranks in the nodes' namespaces, and what they started."""
    marked = f"{JOB_TAG}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # gone meanwhile (a zombie's environment reads empty)
                if marked in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


def end_job(proc: subprocess.Popen[str], tag: str) -> list[int]:
    """End the job of mpiexec ``proc``, tagged ``tag``: SIGTERM to mpiexec's process group
    and to every process with the tag, SIGKILL to what is still there END_GRACE_S later,
    until none is left and mpiexec is reaped (or, past 3 END_GRACE_S, what SIGKILL cannot
    end is left). Ctrl-C and SIGTERM wait until it is done. The processes with the tag
    it found besides mpiexec (none after a job that exited whole)."""
    masked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        found: set[int] = set()
        signalled: set[int] = set()
        start = time.monotonic()
        while True:
            late = time.monotonic() - start > END_GRACE_S
            sig = signal.SIGKILL if late else signal.SIGTERM
            if proc.poll() is None and (late or proc.pid not in signalled):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)  # mpiexec leads a session and a group of its own
                signalled.add(proc.pid)
            left = [pid for pid in job_processes(tag) if pid != proc.pid]
            for pid in left:
                if late or pid not in signalled:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                    signalled.add(pid)
            found.update(left)
            if (not left and proc.poll() is not None) or time.monotonic() - start > 3 * END_GRACE_S:
                return sorted(found)
            time.sleep(0.05)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, masked)


def counters(device: str) -> tuple[int, int]:
    """Bytes received and sent so far by a root-namespace device."""
    stats = Path("/sys/class/net", device, "statistics")
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def mib(nbytes: float) -> str:
    """``12.3 MiB``."""
    return f"{nbytes / (1 << 20):.1f} MiB"


def verify(cluster: Cluster, nbytes: int = CHECK_BYTES) -> None:
    """Ping-pong between the nodes in pairs over the links; ClusterError if they fall short.

    Prints the rate each pair reached and the bytes each link carried. Fails when
    MPI does not see one node per namespace, a message comes back changed, a link
    carried less than the ping-pong sent over it (the messages took another way),
    or a shaped link is off its rate by more than CHECK_TOLERANCE. The rate is the
    best round trip's: processes competing for the CPU slow some round trips
    down, but none beats the link by more than its bucket lets through at once
    (see tbf: 128 KiB, 3 % of the 4 MiB message, up to 10 Gbit/s).
    """
    nodes = cluster.nodes
    pairs = [(i, i + 1) for i in range(0, len(nodes) - 1, 2)]
    if len(nodes) % 2:
        pairs.append((len(nodes) - 1, 0))
    slowest = 8.0 * nbytes / min(cluster.bits(node) or 1e9 for node in nodes)
    command = mpiexec_command(cluster, nodes, 1, "ofi-tcp")
    python = Path(command[0]).parent / "python3"  # the mpich wheel's mpiexec sits beside its python
    command += [str(python) if python.exists() else "python3", str(PINGPONG), "--bytes", str(nbytes)]
    command += ["--pairs", ",".join(f"{a}-{b}" for a, b in pairs)]
    before = {node: counters(cluster.veth(node)) for node in nodes}
    try:
        done = run_job(command, timeout=60 + 16 * slowest * len(pairs), capture=True)
    except subprocess.TimeoutExpired as timeout:
        raise ClusterError(f"the check's ping-pong did not finish in {timeout.timeout:.0f} s") from None
    after = {node: counters(cluster.veth(node)) for node in nodes}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        output = (done.stdout + done.stderr).strip().splitlines()[-20:]
        raise ClusterError(f"the check's ping-pong failed (exit {done.returncode}):\n  " + "\n  ".join(output))
    result = json.loads(lines[-1])
    problems = []
    if result["hosts"] != nodes or result["nodes"] != len(nodes):
        problems.append(f"MPI saw {result['nodes']} nodes with hostnames {result['hosts']}, not one per node")
    sent = dict.fromkeys(nodes, 0)  # bytes the ping-pong sent over each link each way
    for pair in result["pairs"]:
        a, b = (nodes[rank] for rank in pair["ranks"])
        rates = [r for r in (cluster.bits(a), cluster.bits(b)) if r is not None]
        bits = min(rates) if rates else None  # the slower link of the two sets the pace
        times = pair["one_way_s"]
        reached, typical = 8 * nbytes / min(times), 8 * nbytes / statistics.median(times)
        for node in (a, b):
            sent[node] += nbytes * (len(times) + 1)  # with the warm-up round trip
        against = "" if bits is None else f" = {reached / bits:.0%} of the link's {describe_rate(bits)}"
        print(
            f"check  {a} <-> {b}: {mib(nbytes)} ping-pong, best of {len(times)} one way: {describe_rate(reached)} "
            f"({reached / 8e6:.0f} MB/s){against}; median {describe_rate(typical)}"
        )
        if not pair["intact"]:
            problems.append(f"the ping-pong between {a} and {b} came back changed")
        if bits is not None and abs(reached / bits - 1) > CHECK_TOLERANCE:
            cpu = " (more than TCP over veth manages on this CPU?)" if reached < bits else ""
            problems.append(
                f"{a} <-> {b} reached {describe_rate(reached)}, not {describe_rate(bits)} "
                f"within {CHECK_TOLERANCE:.0%}{cpu}"
            )
    for node in nodes:
        out, into = (after[node][i] - before[node][i] for i in (0, 1))  # the veth receives what the node sends
        print(f"check  {node} link: {mib(out)} out, {mib(into)} in; the ping-pong sent {mib(sent[node])} each way")
        if min(out, into) < sent[node]:
            problems.append(f"{node}'s link carried less than the ping-pong sent: the messages went another way")
    if problems:
        raise ClusterError("check failed:\n  " + "\n  ".join(problems))
    print(f"check  ok: {len(nodes)} nodes as MPI sees them ({', '.join(result['hosts'])}), messages over the links")


# --- the subcommands -------------------------------------------------------------------------


def recorded() -> Cluster:
    """The cluster that is up; ClusterError if there is none."""
    cluster = Cluster.load()
    if cluster is None:
        raise ClusterError("no cluster is up: start one with 'cluster.py up --nodes N'")
    return cluster


def link_parameters(args: argparse.Namespace, nodes: list[str]) -> tuple[str | None, dict[str, str], str | None]:
    """The rate, the nodes' own rates (``--node NODE=RATE``) and the delay asked for, each
    checked; ClusterError for an unknown node, a bad rate or a delay this kernel cannot give."""
    parse_rate(args.rate)
    node_rates = {}
    for item in args.node or ():
        node, _, rate = item.partition("=")
        if node not in nodes or not rate:
            raise ClusterError(f"--node {item}: NODE=RATE with NODE one of {', '.join(nodes)}")
        parse_rate(rate)
        node_rates[node] = rate
    delay = parse_delay(args.delay)
    if delay and not netem_available():
        raise ClusterError(
            f"--delay {delay} needs netem (sch_netem, CONFIG_NET_SCH_NETEM), which this kernel "
            f"({os.uname().release}) does not have; leave --delay out (the rate alone is shaped)"
        )
    return args.rate, node_rates, delay


def describe(cluster: Cluster) -> str:
    """One line: the nodes and their links."""
    delay = f", {cluster.delay} one-way delay" if cluster.delay else ""
    own = "".join(f", {node}'s {describe_rate(cluster.bits(node))}" for node in cluster.node_rates)
    return f"{len(cluster.nodes)} nodes on {BRIDGE}, links {describe_rate(parse_rate(cluster.rate))}{own}{delay}"


def cmd_up(args: argparse.Namespace) -> None:
    """Make the cluster, shape its links, check them; on any failure remove it again."""
    if not 2 <= args.nodes <= ipaddress.ip_network(SUBNET).num_addresses - 3:
        raise ClusterError(f"--nodes {args.nodes}: from 2 to {ipaddress.ip_network(SUBNET).num_addresses - 3}")
    names = [f"{NODE_PREFIX}{i}" for i in range(1, args.nodes + 1)]
    rate, node_rates, delay = link_parameters(args, names)
    with locked():
        existing = Cluster.load()
        if existing is not None:
            raise ClusterError(
                f"a cluster is already up ({describe(existing)}, since {existing.created}): "
                "'cluster.py down' first, or 'cluster.py shape' to change its links"
            )
        cluster = Cluster(nodes=names, rate=rate, node_rates=node_rates, delay=delay)
        planned = [("link", BRIDGE)]
        for node in cluster.nodes:
            planned += [("netns", node), ("link", cluster.veth(node)), ("dir", f"/etc/netns/{node}")]
        taken = [name for kind, name in planned if exists(kind, name)]
        used = sh("ip", "-o", "-4", "addr", "show", "to", SUBNET).stdout.split()
        if used:
            taken.append(f"{used[3]} on {used[1]}")
        if taken:
            raise ClusterError(f"already there, not made by cluster.py: {', '.join(taken)}; remove them first")
        try:
            build(cluster)
            shape(cluster)
            print(f"up     {describe(cluster)}, {SUBNET} ({cluster.head_address} = {HEAD_NAME})")
            verify(cluster)
        except BaseException as failure:
            teardown(cluster)
            if isinstance(failure, ClusterError):
                raise ClusterError(f"{failure}\nup failed; what it made is removed again") from None
            raise


def cmd_shape(args: argparse.Namespace) -> None:
    """Give the links of the running cluster another rate or delay, then check them."""
    with locked():
        cluster = recorded()
        cluster.rate, cluster.node_rates, cluster.delay = link_parameters(args, cluster.nodes)
        shape(cluster)
        cluster.save()
        print(f"shape  {describe(cluster)}")
        if not args.no_check:
            verify(cluster)


def cmd_check(args: argparse.Namespace) -> None:
    """Run the check of up again."""
    verify(recorded(), args.bytes)


def cmd_down(args: argparse.Namespace) -> None:
    """Remove what up made; nothing to do when no cluster is up."""
    with locked():
        cluster = Cluster.load()
        if cluster is None:
            print(f"down   no cluster is up (no {STATE}): nothing to remove")
            return
        for note in teardown(cluster):
            print(f"down   {note}")
        print(f"down   removed {len(cluster.made)} things: {describe(cluster)}; none is left")


def cmd_status(args: argparse.Namespace) -> int:
    """Print what the record lists and whether it is there; 0 when the cluster is up and whole."""
    cluster = Cluster.load()
    if cluster is None:
        strays = [BRIDGE] if exists("link", BRIDGE) else []
        strays += sorted(p.name for p in Path("/run/netns").glob("*") if re.fullmatch(rf"{NODE_PREFIX}\d+", p.name))
        print("no cluster is up" + (f"; not recorded but there: {', '.join(strays)}" if strays else ""))
        return 1
    print(f"up since {cluster.created}: {describe(cluster)}, {SUBNET} ({cluster.head_address} = {HEAD_NAME})")
    for node in cluster.nodes:
        out, into = counters(cluster.veth(node)) if exists("link", cluster.veth(node)) else (0, 0)
        pids = sh("ip", "netns", "pids", node, check=False).stdout.split()
        print(f"  {node:8} {cluster.address(node):15} {mib(out)} out, {mib(into)} in, {len(pids)} processes")
    missing = [" ".join(item) for item in cluster.made if not exists(*item)]
    if missing:
        print(f"missing: {', '.join(missing)} ('cluster.py down', then up again)")
        return 1
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run the command on the nodes with mpiexec; its exit status (124: past --timeout,
    130: Ctrl-C), nothing of it left running (run_job)."""
    cluster = recorded()
    if args.n < 1:
        raise ClusterError(f"-n {args.n}: at least 1 rank per node")
    if args.timeout is not None and args.timeout <= 0:
        raise ClusterError(f"--timeout {args.timeout:g}: seconds, more than 0")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ClusterError("no command: cluster.py run -n RANKS_PER_NODE -- COMMAND...")
    if args.nodes is None:
        nodes = cluster.nodes
    elif args.nodes.isdigit():
        nodes = cluster.nodes[: int(args.nodes)]
    else:
        nodes = args.nodes.split(",")
    if not nodes or len(nodes) > len(set(nodes)) or not set(nodes) <= set(cluster.nodes) or (args.nodes or "1") == "0":
        raise ClusterError(f"--nodes {args.nodes}: a count up to {len(cluster.nodes)} or names among {cluster.nodes}")
    full = mpiexec_command(cluster, nodes, args.n, args.netmod) + command
    if args.dry_run:
        print(shlex.join(full))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.stdout.flush()
    try:
        done = run_job(full, args.timeout)
    except subprocess.TimeoutExpired:
        print(
            f"cluster.py run: the job ran past --timeout {args.timeout:g} s; it is ended, on every node",
            file=sys.stderr,
        )
        return 124
    except KeyboardInterrupt:
        print("cluster.py run: interrupted; the job is ended, on every node", file=sys.stderr)
        return 130
    return done.returncode if done.returncode >= 0 else 128 - done.returncode


def main(argv: list[str] | None = None) -> int:
    """Parse the subcommand and run it; 1 with a message for a ClusterError."""
    summary, usage, *_ = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(
        prog="cluster.py", description=summary, epilog=usage, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    links = argparse.ArgumentParser(add_help=False)
    links.add_argument(
        "--rate", help="each node's link rate, both ways, as tc writes it: 100mbit, 1gbit, 10gbit; default: unshaped"
    )
    links.add_argument(
        "--node",
        action="append",
        metavar="NODE=RATE",
        help="this node's link at its own rate, both ways, e.g. node3=100mbit (repeatable)",
    )
    links.add_argument("--delay", help="one-way delay between nodes (100us, 2ms); needs the kernel's sch_netem")

    up = commands.add_parser("up", parents=[links], help="make the nodes and links, then check them")
    up.add_argument("--nodes", type=int, default=2, help="how many nodes (default 2)")
    up.set_defaults(func=cmd_up)
    shape = commands.add_parser("shape", parents=[links], help="change the running cluster's links, then check them")
    shape.add_argument("--no-check", action="store_true", help="do not check the links afterwards")
    shape.set_defaults(func=cmd_shape)
    check = commands.add_parser("check", help="ping-pong between the nodes: MPI sees them, links carry the rate")
    check.add_argument("--bytes", type=int, default=CHECK_BYTES, help="message size (default 4 MiB)")
    check.set_defaults(func=cmd_check)
    commands.add_parser("status", help="what is up; exit 1 when no cluster is (whole)").set_defaults(func=cmd_status)
    commands.add_parser("down", help="remove what up made, and check that nothing is left").set_defaults(func=cmd_down)
    run = commands.add_parser(
        "run",
        help="run an MPI job on the nodes (exit status and output are the job's)",
        description="Run COMMAND with MPICH's hydra, RANKS_PER_NODE ranks on each node; the job's output and "
        "exit status are its own. When it ends, runs past --timeout or is interrupted (Ctrl-C, SIGTERM), every "
        "process it started, on every node, is ended. OMP_NUM_THREADS defaults to 1.",
    )
    run.add_argument("-n", type=int, default=1, metavar="RANKS_PER_NODE", help="ranks on each node (default 1)")
    run.add_argument("--nodes", help="the first N nodes, or names: node1,node3 (default: all)")
    run.add_argument(
        "--netmod",
        choices=NETMODS,
        default="ofi-tcp",
        help="how messages go between nodes: ofi-tcp (default) or ucx-tcp over the links; default: MPICH's "
        "choice, which is shared memory here (the links unused)",
    )
    run.add_argument(
        "--timeout", type=float, help="end the job, on every node, after this many seconds (exit status 124)"
    )
    run.add_argument("--dry-run", action="store_true", help="print the mpiexec command instead of running it")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND...")
    run.set_defaults(func=cmd_run)

    args = parser.parse_args(argv)
    try:
        if args.subcommand not in ("status",):
            require_root_and_tools()
        signal.signal(signal.SIGTERM, _terminated)
        return args.func(args) or 0
    except ClusterError as error:
        print(f"cluster.py {args.subcommand}: error: {error}", file=sys.stderr)
        return 1


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM (e.g. from timeout) as an exception, so that a failing up still removes what it made."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
