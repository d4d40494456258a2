"""``python -m benchmarks.netsim up|status|down|exec|run``: the simulated cluster from the shell.

    python -m benchmarks.netsim up 2 --rate 1gbit                # two nodes, 1 Gbit/s each way
    python -m benchmarks.netsim up 4 --rate 1gbit --delay 0.5ms  # with one-way delay
    python -m benchmarks.netsim status
    python -m benchmarks.netsim exec 1 -- python -c "import socket; print(socket.gethostname())"
    python -m benchmarks.netsim down

    # up, the command once per node with torchrun's environment, down (also on Ctrl-C):
    python -m benchmarks.netsim run 2 --rate 100mbit -- python recipes/train.py world=torchrun

Errors are one line on stderr: exit 2 for a bad argument, 1 when the cluster cannot be
built or used (not root, no iproute2, ...).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading

from .cluster import (
    DEFAULT_PREFIX,
    IFNAME,
    MODES,
    Cluster,
    NetsimError,
    address,
    down,
    missing_prerequisites,
    namespaces,
    node_command,
    parse_delay,
    parse_rate,
    status,
    up,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"netsim: {message}", file=sys.stderr)
        raise SystemExit(2)


def _checked(parse):
    def check(text: str) -> str:
        try:
            parse(text)
        except NetsimError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    return check


def _nodes(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"nodes must be a positive integer, got {text!r}")
    return n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="python -m benchmarks.netsim", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def shaped(q):
        q.add_argument("nodes", type=_nodes, help="number of nodes")
        q.add_argument(
            "--rate",
            type=_checked(parse_rate),
            default="none",
            help="per node and direction: 100mbit, 1gbit, 2.5gbit, ... or none (default)",
        )
        q.add_argument("--delay", type=_checked(parse_delay), default="0", help="one-way: 0 (default), 500us, 2ms")
        q.add_argument("--mode", choices=MODES, default="auto")
        q.add_argument("--mtu", type=int, default=1500)

    for name, helptext in (("up", "(re)build the cluster"), ("run", "up, run a command on every node, down")):
        q = sub.add_parser(name, help=helptext)
        shaped(q)
        q.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"namespace prefix (default {DEFAULT_PREFIX})")
        if name == "run":
            q.add_argument("--port", type=int, default=29500, help="MASTER_PORT (default 29500)")
            q.add_argument("--force", action="store_true", help="rebuild even if the namespaces exist")
    for name, helptext in (("status", "show the cluster"), ("down", "remove the cluster")):
        sub.add_parser(name, help=helptext).add_argument("--prefix", default=DEFAULT_PREFIX)
    q = sub.add_parser("exec", help="run a command in node K")
    q.add_argument("node", type=int)
    q.add_argument("--prefix", default=DEFAULT_PREFIX)
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` is the command, options that look like ours included.
    command = argv[argv.index("--") + 1 :] if "--" in argv else []
    a = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    a.command = command
    if a.cmd in ("run", "exec") and not command:
        p.error(f"{a.cmd}: no command given (put it after --: {a.cmd} ... -- python train.py)")
    return a


def _pump(stream, tag: str) -> None:
    for line in stream:
        sys.stdout.write(f"{tag} {line}")
        sys.stdout.flush()


def _run_everywhere(a: argparse.Namespace) -> int:
    with Cluster(a.nodes, prefix=a.prefix, force=a.force) as net:
        print(net.up(a.rate, a.delay, a.mode, a.mtu), file=sys.stderr, flush=True)
        procs, pumps = [], []
        try:
            for k in range(a.nodes):
                proc = subprocess.Popen(
                    net.command(k, a.command),
                    env={**os.environ, **net.env(k, a.port)},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,
                )
                procs.append(proc)
                pumps.append(threading.Thread(target=_pump, args=(proc.stdout, f"[r{k}]"), daemon=True))
                pumps[-1].start()
            codes = [proc.wait() for proc in procs]
        finally:
            for proc in procs:  # what is still running after an error or a signal
                if proc.poll() is None:
                    os.killpg(proc.pid, 15)
                    proc.wait()
        for t in pumps:
            t.join(timeout=5)
    return next((c for c in codes if c), 0)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        missing = missing_prerequisites()
        if missing:
            raise NetsimError(missing)
        if a.cmd == "up":
            print(up(a.nodes, a.rate, a.delay, a.mode, a.mtu, a.prefix))
        elif a.cmd == "down":
            left = down(a.prefix)
            if left:
                raise NetsimError(f"could not remove {', '.join(left)}")
            print(f"netsim: down, no {a.prefix}-* namespace left")
        elif a.cmd == "status":
            print(status(a.prefix))
        elif a.cmd == "exec":
            ns = f"{a.prefix}-node{a.node}"
            if ns not in namespaces(a.prefix):
                raise NetsimError(f"there is no node {a.node} ({ns}); run `python -m benchmarks.netsim up N` first")
            env = {"GLOO_SOCKET_IFNAME": IFNAME, "MASTER_ADDR": address(0), **os.environ}
            os.execvpe("ip", node_command(a.node, a.command, a.prefix), env)
        else:
            return _run_everywhere(a)
    except NetsimError as error:
        print(f"netsim: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netsim: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
