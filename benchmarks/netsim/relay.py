"""The user-space switch of the ``tun`` back-end: one-way delay and a downlink rate per node.

Kernels built without ``sch_netem`` cannot delay packets in ``tc``. There every node's
``nsim0`` is a TUN device instead of a veth, and this process, started by
``benchmarks.netsim.cluster`` inside the switch namespace, holds all of them: it reads each
IPv4 packet a node sends, holds it for the delay, and writes it into the TUN of the node it
is addressed to. It also queues packets per destination at the link rate, so a node's
downlink is limited as a NIC's would be (the uplink is a ``tbf`` on the node's ``nsim0``).
Packets to any address other than the N nodes are dropped: nothing leaves the simulation.

The TUN devices carry a virtio-net header and accept TSO, so the kernel hands over whole
64 KiB segments rather than MTU-sized frames; that keeps a Python loop near 3 Gbit/s.

Standard library only; Linux; needs CAP_NET_ADMIN and CAP_SYS_ADMIN (``setns``).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import os
import select
import signal
import struct
import sys
import time

_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TUN, _IFF_NO_PI, _IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6 = 0x01, 0x02, 0x04
_CLONE_NEWNET = 0x40000000
_PR_SET_TIMERSLACK = 29
VNET_HDR_BYTES = 10  # struct virtio_net_hdr, without the num_buffers field
_DST_OFFSET = VNET_HDR_BYTES + 16  # IPv4 destination address
READY = "ready"


def destination(packet: bytes, subnet: bytes, nodes: int) -> int | None:
    """Index of the node ``packet`` (virtio-net header + IPv4) is addressed to, or None.

    Node k has address ``subnet.(k+1)``; anything else (other hosts, broadcast, IPv6)
    has no destination here and is dropped.

    >>> hdr = bytes(VNET_HDR_BYTES)
    >>> ip = bytes([0x45]) + bytes(15) + bytes([10, 77, 0, 2])
    >>> destination(hdr + ip, bytes([10, 77, 0]), nodes=2)
    1
    >>> destination(hdr + ip, bytes([10, 77, 0]), nodes=1) is None
    True
    """
    if len(packet) < _DST_OFFSET + 4 or packet[VNET_HDR_BYTES] >> 4 != 4:
        return None
    if packet[_DST_OFFSET : _DST_OFFSET + 3] != subnet:
        return None
    k = packet[_DST_OFFSET + 3] - 1
    return k if 0 <= k < nodes else None


def departure(now: float, size: int, link_free_at: float, delay_s: float, rate_bps: float) -> float:
    """When a packet of ``size`` bytes that arrived at ``now`` has left the destination's link.

    The packet is delayed first, then waits for the link (one packet at a time, at
    ``rate_bps``; 0 = unlimited) and takes ``size * 8 / rate_bps`` to pass.

    >>> departure(now=1.0, size=125_000, link_free_at=0.0, delay_s=0.5, rate_bps=1e6)
    2.5
    >>> departure(now=1.0, size=125_000, link_free_at=3.0, delay_s=0.5, rate_bps=1e6)
    4.0
    """
    ready = now + delay_s
    if not rate_bps:
        return ready
    return max(ready, link_free_at) + size * 8 / rate_bps


def _attach(netns_path: str, ifname: str) -> int:
    """Open the TUN device ``ifname`` of the namespace at ``netns_path`` (this thread joins it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(netns_path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {netns_path}: {os.strerror(err)}")
    finally:
        os.close(fd)
    tun = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(tun, _TUNSETIFF, struct.pack("16sH", ifname.encode(), _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR))
    fcntl.ioctl(tun, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
    return tun


def _forward(tuns: list[int], subnet: bytes, delay_s: float, rate_bps: float, queue_s: float) -> None:
    """Move packets between the nodes until a signal ends the process."""
    n = len(tuns)
    queues = [collections.deque() for _ in range(n)]  # per destination: (departure, packet)
    free_at = [0.0] * n
    clock = time.monotonic
    while True:
        heads = [q[0][0] for q in queues if q]
        wait = max(0.0, min(heads) - clock()) if heads else None
        readable, _, _ = select.select(tuns, [], [], wait if wait is None or wait > 30e-6 else 0.0)
        now = clock()
        for fd in readable:
            for _ in range(256):  # drain what is there, but let the other nodes in
                try:
                    packet = os.read(fd, 65536 + VNET_HDR_BYTES + 64)
                except BlockingIOError:
                    break
                d = destination(packet, subnet, n)
                if d is None:
                    continue
                out = departure(now, len(packet) - VNET_HDR_BYTES, free_at[d], delay_s, rate_bps)
                if rate_bps and out - now - delay_s > queue_s:  # a full queue drops, as tbf's would
                    continue
                free_at[d] = out
                queues[d].append((out, packet))
        now = clock()
        for d, q in enumerate(queues):
            while q and q[0][0] <= now:
                try:
                    os.write(tuns[d], q.popleft()[1])
                except OSError:  # the node's queue is full: the packet is lost, TCP resends it
                    pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="netsim tun relay (started by benchmarks.netsim)")
    p.add_argument("--netns", nargs="+", required=True, help="paths of the node namespaces, node 0 first")
    p.add_argument("--ifname", default="nsim0")
    p.add_argument("--subnet", default="10.77.0", help="first three octets of the node addresses")
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--rate-bps", type=float, default=0.0, help="downlink rate per node; 0 = unlimited")
    p.add_argument("--queue-s", type=float, default=0.05, help="longest wait for the downlink before a drop")
    a = p.parse_args(argv)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    tuns = [_attach(path, a.ifname) for path in a.netns]
    # Back to the switch namespace: that is where `down` looks for this process.
    if ctypes.CDLL(None, use_errno=True).setns(home, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns back to the switch namespace")
    os.close(home)
    ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # 1 us: the 50 us default would add to every delay

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(READY, flush=True)
    # The starter stops reading after READY; later writes must not hit a closed pipe.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.dup2(devnull, sys.stderr.fileno())
    _forward(tuns, bytes(int(x) for x in a.subnet.split(".")), a.delay_s, a.rate_bps, a.queue_s)


if __name__ == "__main__":
    main()
