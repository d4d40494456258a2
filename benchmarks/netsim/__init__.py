"""A simulated multi-node cluster on one Linux host, for fdp's multi-node benchmarks.

N network namespaces with shaped links (``tbf`` for the rate; ``netem``, or a user-space
relay where the kernel has none, for the delay); one rank per namespace. From the shell:

    python -m benchmarks.netsim up 2 --rate 1gbit    # root; iproute2
    python -m benchmarks.netsim status
    python -m benchmarks.netsim run 2 --rate 100mbit -- python recipes/train.py world=torchrun
    python -m benchmarks.netsim down

From Python, ``Cluster`` takes the network down however the program ends.
"""

from .cluster import (
    DEFAULT_PREFIX,
    IFNAME,
    SUBNET,
    Cluster,
    NetsimError,
    address,
    down,
    missing_prerequisites,
    namespaces,
    node_command,
    node_env,
    parse_delay,
    parse_rate,
    status,
    up,
)

__all__ = [
    "DEFAULT_PREFIX",
    "IFNAME",
    "SUBNET",
    "Cluster",
    "NetsimError",
    "address",
    "down",
    "missing_prerequisites",
    "namespaces",
    "node_command",
    "node_env",
    "parse_delay",
    "parse_rate",
    "status",
    "up",
]
