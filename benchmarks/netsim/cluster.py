"""A simulated cluster on one Linux host: N network namespaces joined by shaped links.

Node k is the namespace ``<prefix>-node<k>`` with one interface, ``nsim0``, at
``10.77.0.<k+1>/24``, and no default route: its traffic can only reach the other nodes.
The nodes meet in a switch namespace, ``<prefix>-sw``. Nothing is added to the host's
own namespace. Two back-ends:

* ``veth``: ``nsim0`` is a veth whose peer ``p<k>`` is a port of bridge ``br0`` in the
  switch. A ``tbf`` on ``nsim0`` limits what the node sends, a ``tbf`` on ``p<k>`` what it
  receives: a full-duplex NIC of the chosen rate. A delay is a ``netem`` at the root of
  ``nsim0`` with the uplink ``tbf`` as its child, on kernels that have ``sch_netem``.
* ``tun``: for a delay on kernels without ``netem``. ``nsim0`` is a TUN device, and
  ``relay.py`` (a process in the switch namespace) moves packets between the nodes after
  the delay and at the downlink rate; the uplink is again a ``tbf`` on ``nsim0``.

``auto`` takes ``veth`` unless a delay is asked for and the kernel has no ``netem``.

Needs root and iproute2 (``ip``, ``tc``); ``missing_prerequisites`` names what is missing
in one line. ``Cluster`` is the context manager the benchmarks use: it takes the network
down when the block ends, on an exception, on SIGINT/SIGTERM/SIGHUP and at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PREFIX = "fdpsim"
SUBNET = "10.77.0"
IFNAME = "nsim0"
MODES = ("auto", "veth", "tun")
MAX_NODES = 250  # node k is 10.77.0.<k+1>
TBF_LATENCY = "50ms"  # longest a packet may queue in a tbf before it is dropped
MIN_BURST_BYTES = 128 * 1024
NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` mounts the namespaces
RELAY = Path(__file__).resolve().with_name("relay.py")

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_RATE_UNIT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_DELAY = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)?$")
_DELAY_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}


class NetsimError(RuntimeError):
    """The simulated cluster cannot be built, used or taken down; the message is one line."""


def parse_rate(text: str) -> int:
    """Link rate in bit/s from tc's notation; ``none`` (or 0) is an unshaped link, 0.

    >>> parse_rate("2.5gbit"), parse_rate("100mbit"), parse_rate("none")
    (2500000000, 100000000, 0)
    """
    t = str(text).strip().lower()
    if t in ("none", "0", "off", ""):
        return 0
    m = _RATE.match(t)
    if not m:
        raise NetsimError(f"rate must look like 100mbit, 1gbit, 2.5gbit or none, got {text!r}")
    return round(float(m.group(1)) * _RATE_UNIT[m.group(2)])


def parse_delay(text: str) -> float:
    """One-way delay in seconds; a bare number is milliseconds.

    >>> parse_delay("500us"), parse_delay("2ms"), parse_delay("0")
    (0.0005, 0.002, 0.0)
    """
    t = str(text).strip().lower()
    if t in ("none", "off", ""):
        return 0.0
    m = _DELAY.match(t)
    if not m:
        raise NetsimError(f"delay must look like 0, 500us, 0.5ms or 2ms, got {text!r}")
    return float(m.group(1)) * _DELAY_UNIT[m.group(2)]


def missing_prerequisites(euid: int | None = None, path: str | None = None) -> str | None:
    """One line naming what this host lacks to run the simulated cluster, or None.

    ``euid`` and ``path`` default to this process's user and ``PATH``.

    >>> missing_prerequisites(euid=1000, path="")
    'the simulated cluster needs root (network namespaces, tc) and iproute2 (`ip` and `tc` are not on PATH)'
    """
    lacks = []
    if (os.geteuid() if euid is None else euid) != 0:
        lacks.append("root (network namespaces, tc)")
    absent = [tool for tool in ("ip", "tc") if shutil.which(tool, path=path) is None]
    if absent:
        lacks.append(
            f"iproute2 ({' and '.join(f'`{t}`' for t in absent)} {'is' if len(absent) == 1 else 'are'} not on PATH)"
        )
    return f"the simulated cluster needs {' and '.join(lacks)}" if lacks else None


@dataclass(frozen=True)
class Names:
    """Where the pieces of a cluster live; ``prefix`` keeps two clusters apart.

    >>> Names("fdpsim").node(1), Names("fdpsim").switch, address(1)
    ('fdpsim-node1', 'fdpsim-sw', '10.77.0.2')
    """

    prefix: str = DEFAULT_PREFIX

    def node(self, k: int) -> str:
        return f"{self.prefix}-node{k}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def owns(self, namespace: str) -> bool:
        return re.fullmatch(rf"{re.escape(self.prefix)}-(node\d+|sw|probe\d+)", namespace) is not None


def address(k: int) -> str:
    return f"{SUBNET}.{k + 1}"


def node_command(k: int, argv: list[str], prefix: str = DEFAULT_PREFIX) -> list[str]:
    """``argv`` run inside node ``k`` (the environment is passed on unchanged).

    >>> node_command(0, ["python", "-V"])
    ['ip', 'netns', 'exec', 'fdpsim-node0', 'python', '-V']
    """
    return ["ip", "netns", "exec", Names(prefix).node(k), *argv]


def node_env(k: int, world: int, port: int) -> dict[str, str]:
    """What ``torchrun`` would set for rank ``k`` of ``world``, one rank per node, plus gloo's interface.

    Without ``GLOO_SOCKET_IFNAME`` gloo resolves the host name, which inside a node
    namespace is 127.0.0.1, and the ranks cannot reach each other.

    >>> node_env(1, 2, 29500)["MASTER_ADDR"], node_env(1, 2, 29500)["RANK"]
    ('10.77.0.1', '1')
    """
    return {
        "RANK": str(k),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(k),
        "MASTER_ADDR": address(0),
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": IFNAME,
    }


def tbf_burst(rate_bps: int) -> int:
    """Bytes a tbf may send at once: 1 ms at the rate, and at least 128 KiB, so that a 64 KiB
    GSO segment always fits in the bucket and is not cut into MTU-sized packets.

    >>> tbf_burst(10**9), tbf_burst(10**10)
    (131072, 1250000)
    """
    return max(rate_bps // 8 // 1000, MIN_BURST_BYTES)


# ----------------------------------------------------------------------------- running iproute2
def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if check and proc.returncode != 0:
        why = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise NetsimError(f"`{' '.join(argv)}` failed: {why[-1] if why else f'exit {proc.returncode}'}")
    return proc


def namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The namespaces of the cluster called ``prefix`` that exist now."""
    out = _run(["ip", "netns", "list"]).stdout
    names = Names(prefix)
    found = [ln.split()[0] for ln in out.splitlines() if ln.strip() and names.owns(ln.split()[0])]
    return sorted(found, key=lambda ns: (len(ns), ns))  # node2 before node10


def _nodes(prefix: str) -> list[str]:
    return [ns for ns in namespaces(prefix) if "-node" in ns]


def has_netem(prefix: str = DEFAULT_PREFIX) -> bool:
    """Whether the kernel has ``sch_netem``, tried on a veth in a throw-away namespace."""
    probe = f"{prefix}-probe{os.getpid()}"
    _run(["ip", "netns", "add", probe])
    try:
        _run(["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        return (
            _run(
                ["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "netem", "delay", "1ms"], check=False
            ).returncode
            == 0
        )
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def _shape(ns: str, dev: str, rate_bps: int, delay_s: float = 0.0) -> None:
    """Replace the root qdisc of ``dev``: a tbf at ``rate_bps`` (none at 0), under a netem delay if any."""
    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    parent = ["root", "handle", "1:"]
    if delay_s:
        _run(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                f"{delay_s * 1e6:.0f}us",
                "limit",
                "100000",
            ]
        )
        parent = ["parent", "1:1", "handle", "10:"]
    if rate_bps:
        _run(
            [
                "tc",
                "-n",
                ns,
                "qdisc",
                "add",
                "dev",
                dev,
                *parent,
                "tbf",
                "rate",
                f"{rate_bps}bit",
                "burst",
                str(tbf_burst(rate_bps)),
                "latency",
                TBF_LATENCY,
            ]
        )


def _wait_forwarding(switch: str, port: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while "state forwarding" not in _run(["ip", "-n", switch, "-d", "link", "show", port]).stdout:
        if time.monotonic() > deadline:
            raise NetsimError(f"bridge port {port} in {switch} did not start forwarding within {timeout_s:.0f} s")
        time.sleep(0.05)


def _start_relay(names: Names, nodes: int, delay_s: float, rate_bps: int) -> int:
    """Start the tun relay in the switch namespace, detached (it outlives a CLI ``up``); its pid."""
    argv = [
        "ip",
        "netns",
        "exec",
        names.switch,
        sys.executable,
        str(RELAY),
        "--netns",
        *(str(NETNS_DIR / names.node(k)) for k in range(nodes)),
        "--ifname",
        IFNAME,
        "--subnet",
        SUBNET,
        "--delay-s",
        repr(delay_s),
        "--rate-bps",
        str(rate_bps),
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 15.0)
    line = proc.stdout.readline().strip() if ready else ""
    if line != "ready":
        try:  # a relay that failed is exiting with its traceback: let it finish
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        said = [line, *proc.stdout.read().strip().splitlines()] if line else []
        raise NetsimError(f"the tun relay did not start: {said[-1] if said else 'no answer in 15 s'}")
    proc.stdout.close()
    return proc.pid


def _relay_pids(names: Names) -> list[int]:
    if names.switch not in namespaces(names.prefix):
        return []
    pids = []
    for pid in _run(["ip", "netns", "pids", names.switch], check=False).stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(RELAY).encode() in cmdline or any(arg.endswith(b"netsim/relay.py") for arg in cmdline):
            pids.append(int(pid))
    return pids


def _stop(pid: int, grace_s: float = 5.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        try:  # our own child: reap it, or it lingers as a zombie
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.05)
    if Path(f"/proc/{pid}").exists():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _check_connectivity(names: Names, timeout_s: float = 5.0) -> None:
    """Node 0 opens a TCP connection to a closed port of node 1: "refused" proves the path works."""
    probe = (
        "import socket,sys\n"
        f"s=socket.socket(); s.settimeout({timeout_s})\n"
        f"try: s.connect(('{address(1)}', 9))\n"
        "except ConnectionRefusedError: sys.exit(0)\n"
        "except OSError as e: sys.exit(f'{type(e).__name__}: {e}')\n"
        "sys.exit('port 9 accepted a connection')\n"
    )
    proc = _run(node_command(0, [sys.executable, "-c", probe], names.prefix), check=False)
    if proc.returncode != 0:
        raise NetsimError(f"{names.node(0)} cannot reach {address(1)}: {proc.stderr.strip() or proc.returncode}")


def mode_of(prefix: str = DEFAULT_PREFIX) -> str | None:
    """``veth`` or ``tun`` for a running cluster, None when there is none."""
    names = Names(prefix)
    if names.node(0) not in namespaces(prefix):
        return None
    link = _run(["ip", "-n", names.node(0), "-d", "link", "show", IFNAME], check=False).stdout
    return "tun" if "tun type tun" in link else "veth"


# ----------------------------------------------------------------------------- up / down / status
def up(
    nodes: int, rate: str = "none", delay: str = "0", mode: str = "auto", mtu: int = 1500, prefix: str = DEFAULT_PREFIX
) -> str:
    """(Re)build the cluster: ``nodes`` namespaces, ``rate`` per node and direction, one-way ``delay``.

    A cluster of the same ``prefix`` is taken down first. Returns a one-line summary.
    """
    if not 1 <= nodes <= MAX_NODES:
        raise NetsimError(f"nodes must be between 1 and {MAX_NODES}, got {nodes}")
    if mode not in MODES:
        raise NetsimError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not 68 <= mtu <= 65535:
        raise NetsimError(f"mtu must be between 68 and 65535, got {mtu}")
    rate_bps, delay_s = parse_rate(rate), parse_delay(delay)
    missing = missing_prerequisites()
    if missing:
        raise NetsimError(missing)
    names = Names(prefix)
    down(prefix)
    netem = bool(delay_s) and mode != "tun" and has_netem(prefix)
    if mode == "auto":
        mode = "tun" if delay_s and not netem else "veth"
    if mode == "veth" and delay_s and not netem:
        raise NetsimError(f"this kernel has no netem, so delay {delay} needs mode tun (or auto)")
    if mode == "tun" and not Path("/dev/net/tun").exists():
        raise NetsimError("mode tun needs /dev/net/tun (CONFIG_TUN)")
    try:
        _build(names, nodes, rate_bps, delay_s, mode, mtu)
    except BaseException:
        down(prefix)  # a half-built cluster is of no use to anyone
        raise
    shown = "none" if not rate_bps else rate
    return (
        f"netsim: up, {nodes} node(s), mode {mode}, rate {shown} per node and direction, delay {delay_s * 1e3:g} ms; "
        f"node k = {SUBNET}.<k+1> on {IFNAME} in netns {names.node(0)[:-1]}<k>"
    )


def _build(names: Names, nodes: int, rate_bps: int, delay_s: float, mode: str, mtu: int) -> None:
    sw = names.switch
    _run(["ip", "netns", "add", sw])
    _run(["ip", "-n", sw, "link", "set", "lo", "up"])
    if mode == "veth":
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        _run(["ip", "-n", sw, "link", "set", "br0", "mtu", str(mtu), "up"])
    for k in range(nodes):
        ns = names.node(k)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if mode == "veth":
            _run(["ip", "-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", f"p{k}", "netns", sw])
            _run(["ip", "-n", sw, "link", "set", f"p{k}", "mtu", str(mtu), "master", "br0", "up"])
        else:
            _run(["ip", "-n", ns, "tuntap", "add", "dev", IFNAME, "mode", "tun", "vnet_hdr"])
        # No IPv6 link-local address: no router solicitations or DAD in the shaped queues.
        _run(["ip", "-n", ns, "link", "set", IFNAME, "mtu", str(mtu), "addrgenmode", "none"])
        _run(["ip", "-n", ns, "addr", "add", f"{address(k)}/24", "dev", IFNAME])
        _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
    for k in range(nodes):
        _shape(names.node(k), IFNAME, rate_bps, delay_s if mode == "veth" else 0.0)  # uplink
        if mode == "veth":
            _shape(sw, f"p{k}", rate_bps)  # downlink
            _wait_forwarding(sw, f"p{k}")
    if mode == "tun":
        _start_relay(names, nodes, delay_s, rate_bps)
    if nodes >= 2:
        _check_connectivity(names)


def down(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Stop the relay and delete every namespace of the cluster; the ones still there (none if it worked)."""
    names = Names(prefix)
    for pid in _relay_pids(names):
        _stop(pid)
    for ns in namespaces(prefix):
        if "-node" in ns:  # a persistent TUN outlives nothing, but delete it explicitly before its namespace
            _run(["ip", "-n", ns, "link", "del", IFNAME], check=False)
        _run(["ip", "netns", "del", ns], check=False)
    return namespaces(prefix)


def status(prefix: str = DEFAULT_PREFIX) -> str:
    """Addresses, qdiscs and byte counters of every node; the switch's ports; the relay."""
    names = Names(prefix)
    mode = mode_of(prefix)
    if mode is None:
        return f"netsim: no cluster {prefix!r} is up"
    lines = [f"netsim: cluster {prefix!r}, mode {mode}, {len(_nodes(prefix))} node(s)"]
    for ns in _nodes(prefix):
        lines.append(f"== {ns}")
        lines += ["   " + ln for ln in _run(["ip", "-n", ns, "-br", "addr", "show", "dev", IFNAME]).stdout.splitlines()]
        lines += [
            "   " + ln for ln in _run(["ip", "-n", ns, "-s", "link", "show", "dev", IFNAME]).stdout.splitlines()[2:6]
        ]
        lines += ["   " + ln for ln in _run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", IFNAME]).stdout.splitlines()]
    lines.append(f"== {names.switch}")
    lines += ["   " + ln for ln in _run(["ip", "-n", names.switch, "-br", "link", "show"]).stdout.splitlines()]
    lines += [
        "   " + ln
        for ln in _run(["tc", "-n", names.switch, "qdisc", "show"]).stdout.splitlines()
        if "noqueue" not in ln
    ]
    relays = _relay_pids(names)
    if mode == "tun":
        lines.append(f"relay: pid {', '.join(map(str, relays))}" if relays else "relay: NOT RUNNING")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the context manager
_TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Cluster:
    """A cluster that is taken down when the ``with`` block ends, however it ends.

    ``up`` may be called again to rebuild at another rate. SIGTERM and SIGHUP, where
    nobody handles them yet, raise ``SystemExit(128 + signal)`` so that the block unwinds
    (SIGINT raises ``KeyboardInterrupt`` as usual); an ``atexit`` hook covers an exit that
    skips the block's end. Only SIGKILL leaves the namespaces behind: then
    ``python -m benchmarks.netsim down`` removes them.

        with Cluster(nodes=2) as net:
            print(net.up(rate="1gbit"))
            subprocess.run(net.command(0, ["python", "-V"]), env={**os.environ, **net.env(0, 29500)})
    """

    def __init__(self, nodes: int, prefix: str = DEFAULT_PREFIX, force: bool = False):
        self.nodes, self.prefix, self.force = nodes, prefix, force
        self._old_handlers: dict = {}
        self._entered = False

    def __enter__(self) -> Cluster:
        missing = missing_prerequisites()
        if missing:
            raise NetsimError(missing)
        existing = namespaces(self.prefix)
        if existing and not self.force:
            raise NetsimError(
                f"namespaces {', '.join(existing)} already exist (another run, or one that was killed); "
                f"remove them with `python -m benchmarks.netsim down --prefix {self.prefix}`, or rebuild them (--force)"
            )
        for sig in _TEARDOWN_SIGNALS:
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        atexit.register(self._teardown)
        self._entered = True
        return self

    def up(self, rate: str = "none", delay: str = "0", mode: str = "auto", mtu: int = 1500) -> str:
        if not self._entered:
            raise NetsimError("use the cluster inside `with Cluster(...) as net:`, so that it is taken down")
        return up(self.nodes, rate, delay, mode, mtu, self.prefix)

    def command(self, k: int, argv: list[str]) -> list[str]:
        return node_command(k, argv, self.prefix)

    def env(self, k: int, port: int) -> dict[str, str]:
        return node_env(k, self.nodes, port)

    def __exit__(self, *exc) -> bool:
        self._teardown()
        return False

    def _teardown(self) -> None:
        if not self._entered:
            return
        # A second Ctrl-C must not cut the teardown short.
        ignored = {s: signal.signal(s, signal.SIG_IGN) for s in _TEARDOWN_SIGNALS}
        try:
            try:
                left = down(self.prefix)
            except NetsimError as error:
                left = [f"({error})"]
            if left:
                print(f"netsim: WARNING, not removed: {', '.join(left)}", file=sys.stderr, flush=True)
            else:
                print(f"netsim: down, no {self.prefix}-* namespace left", file=sys.stderr, flush=True)
        finally:
            for s, h in ignored.items():
                signal.signal(s, self._old_handlers.pop(s, h))
            atexit.unregister(self._teardown)
            self._entered = False


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
