"""Two-level reduction: inside each node first, the hook chain across nodes, then back.

Across nodes the link is slow and inside a node it is fast, so a node first sums its
ranks' buckets over the fast links, one process per node (its local rank 0, the
*leader*) runs the configured chain with the other leaders (compression, if any, only on
the slow link), and each leader broadcasts the result inside its node. For ``allreduce``
the result is the flat average up to float rounding, and only the leaders' traffic
crosses nodes.

A node is the processes of one launch (``LOCAL_WORLD_SIZE``, or ``world.node_size``),
ranks ``n * node_size ... (n + 1) * node_size - 1``, as torchrun numbers them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from fdp.comm import Comm, Pending, new_group
from fdp.hooks.base import GradBucket, Hook, drive_hook

__all__ = ["NodeComms", "check_node_size", "hierarchical", "node_comms", "node_group"]


def check_node_size(world_size: int, node_size: int, least: int = 2) -> int:
    """The number of nodes; a ``ValueError`` unless ``node_size`` splits the world into ``least`` or more (one is
    enough for a world that lost its other nodes: ``fdp.procs.shrink.whole_groups``).

    >>> check_node_size(4, 2)
    2
    >>> check_node_size(2, 2)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ValueError: world.hierarchical=true: expected more than one node, got one node of 2 processes
    (set world.node_size to the processes per node)
    """
    if node_size < 1 or world_size % node_size:
        raise ValueError(f"world.node_size={node_size}: expected a divisor of the world size {world_size}")
    if world_size // node_size < least:
        raise ValueError(
            f"world.hierarchical=true: expected more than one node, got one node of {node_size} processes "
            "(set world.node_size to the processes per node)"
        )
    return world_size // node_size


def node_group(node_size: int, least: int = 2):
    """This rank's node as a process group: the ``node_size`` consecutive ranks it is among, once ``node_size`` splits
    the world into ``least`` nodes or more (``check_node_size``). Every rank must call it, in the same order: it
    makes every node's group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_node_size(world, node_size, least)
    node = None
    for first in range(0, world, node_size):  # new_group is collective: every rank makes every group
        group = new_group(list(range(first, first + node_size)))
        if first <= rank < first + node_size:
            node = group
    return node


class NodeComms(NamedTuple):
    """This rank's two groups: ``node`` (its node's ranks) and ``leaders`` (``None`` off the leaders)."""

    node: Comm
    leaders: Comm | None


def node_comms(node_size: int, least: int = 2, watch=None) -> NodeComms:
    """Make the groups of ``hierarchical`` (every rank must call it, in the same order); ``least``: the fewest
    nodes accepted (``check_node_size``); ``watch`` is asked while their collectives wait
    (``fdp.comm.wait_watched``: a world that may shrink ends them once a rank is reported lost)."""
    node = node_group(node_size, least)
    world, rank = dist.get_world_size(), dist.get_rank()
    leaders = new_group(list(range(0, world, node_size)))
    return NodeComms(Comm(node, watch=watch), Comm(leaders, watch=watch) if rank % node_size == 0 else None)


class _Shadow(Comm):
    """Stands in for the leaders' group on the other ranks: same world size, nothing sent.

    Non-leaders run the chain on it (and discard the result) so that their chain takes as
    many rounds as the leader's and their broadcasts inside the node are issued in the
    same order as the leader's, whatever the chain.
    """

    def __init__(self, world_size: int):
        super().__init__()
        self._world = world_size

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return 0

    def allreduce(self, tensor: torch.Tensor) -> Pending:
        return Pending(tensor.mul_(self._world))

    def allgather(self, tensor: torch.Tensor) -> Pending:
        return Pending(tensor.unsqueeze(0).expand(self._world, *tensor.shape).clone())

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        return Pending(tensor)


def hierarchical(hook: Hook, comms: NodeComms, nodes: int) -> Hook:
    """Run ``hook`` across ``nodes`` nodes only, with a sum inside each node before and a broadcast after.

    The ``comm`` the runtime passes is not used for data; the bytes the leaders send
    across nodes are added to its counters, so ``bytes_sent`` is the traffic on the slow
    link (zero on the other ranks).
    """
    shadow = _Shadow(nodes)

    def apply(state, grads: GradBucket, comm: Comm):
        buffer = grads.buffer if grads.owned else grads.buffer.clone()
        summed = yield comm_node.allreduce(buffer)
        # The chain sees a node's mean as one rank's gradient and averages it over the nodes.
        node_mean = grads._replace(buffer=summed.div_(comm_node.world_size), owned=True)
        across = comms.leaders or shadow
        out, state = yield from drive_hook(hook.apply(state, node_mean, across))
        if comms.leaders is not None:
            sent, count = comms.leaders.take_counters()
            comm.bytes_sent += sent
            comm.collectives += count
            result = out.buffer.contiguous()
        else:
            result = summed  # the leader's result arrives here
        if result.dtype != grads.spec.torch_dtype or result.numel() != grads.spec.numel:
            raise ValueError(
                f"hierarchical: the hook chain must end in the bucket's dtype {grads.spec.dtype}, got {result.dtype}"
            )
        shared = yield comm_node.broadcast(result, 0)
        return grads._replace(buffer=shared, owned=True), state

    comm_node = comms.node
    return Hook(hook.init, apply)
