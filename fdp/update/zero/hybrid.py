"""Hybrid sharding (HSDP): the state sharded inside each group of ranks, replicated across the groups.

With ``world.hierarchical=true`` and a ZeRO stage, the ranks form groups of ``node_size``
(one node each, ranks ``n * node_size ... (n + 1) * node_size - 1``). A group is the
*shard world*: the layout (``fdp.update.zero.layout``) splits each bucket over its ranks,
the updated slices are all-gathered inside it, and stage 3 gathers params inside it. The
*replicas* are the ranks that hold the same slice, one in each group (ranks ``r``,
``r + node_size``, ...).

A bucket's reduction (``across_replicas``) has two legs: the bucket is reduce-scattered
inside the group over the fast links, in the bucket's own dtype, so each rank holds its
slice of the group's mean (``1 / node_size`` of the bucket), then that slice goes through
the hook chain across the replicas, over the slow links: compression and
``trainer.reduce_dtype`` apply there. Each rank sends ``1 / node_size`` of what a rank of a
flat ZeRO world sends across nodes, and the gathers send nothing across.

>>> from fdp.plan import pack_into_buckets
>>> slice_bucket(pack_into_buckets([("w", (5,), "float32", "cpu")]).buckets[0], 2).numel
3
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

from fdp.comm import Comm, new_group
from fdp.hooks import Hook, hook_name
from fdp.hooks.base import GradBucket, drive_hook
from fdp.hooks.hierarchical import node_group
from fdp.hooks.registry import shardable_hooks
from fdp.plan import Bucket, BucketPlan, ParamSlot
from fdp.update.zero.layout import slice_key, slice_numel
from fdp.update.zero.scatter import ScatterComm

__all__ = [
    "ShardGroups",
    "shard_groups",
    "replica_group",
    "refuses_outer",
    "slice_bucket",
    "slice_plan",
    "across_replicas",
    "check_hook_across_nodes",
]


class ShardGroups(NamedTuple):
    """This rank's two groups under hybrid sharding: ``shard`` (the ranks the state is split over, its node) and
    ``replicas`` (the ranks holding the same slice as this one, one per group)."""

    shard: Comm
    replicas: Comm


def shard_groups(node_size: int, watch=None, least: int = 2) -> ShardGroups:
    """Make the groups of hybrid sharding over the world (every rank must call it, in the same order).

    ``node_size`` must split the world into ``least`` or more groups (``check_node_size``; one is
    enough for a world that lost the others, ``fdp.procs.shrink.whole_groups``); ``watch``
    is asked while their collectives wait (``fdp.comm.wait_watched``).
    """
    return ShardGroups(Comm(node_group(node_size, least), watch=watch), replica_group(node_size, watch))


def replica_group(node_size: int, watch=None) -> Comm:
    """This rank's replicas under hybrid sharding (ranks ``r % node_size``, ``+ node_size``, ...), on a process group
    made now: every rank must call it, in the same order (each call makes new groups)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas = None
    for offset in range(node_size):  # new_group is collective: every rank makes every group
        group = new_group([offset + n * node_size for n in range(world // node_size)])
        if rank % node_size == offset:
            replicas = group
    return Comm(replicas, watch=watch)


def refuses_outer(stage: int, hierarchical: bool) -> str | None:
    """Why an outer loop (``outer=local_sgd|diloco``) cannot run over ZeRO stage ``stage``, or ``None``.

    An outer loop syncs replicas that step apart between syncs. Under hybrid sharding each group is one
    (``fdp.update.zero.replicas``); a flat ZeRO world is a single replica whose every step already reduces over
    every rank: there is no other replica to sync with and no traffic between syncs to save.

    >>> refuses_outer(3, hierarchical=True) is None, refuses_outer(0, hierarchical=False) is None
    (True, True)
    >>> refuses_outer(2, hierarchical=False).startswith("a flat ZeRO world is one replica")
    True
    """
    if not stage or hierarchical:
        return None
    return (
        "a flat ZeRO world is one replica, whose every step reduces over all ranks: an outer loop would have no "
        "other replica to sync with; world.hierarchical=true makes each node's group of world.node_size ranks one"
    )


def slice_bucket(bucket: Bucket, shards: int) -> Bucket:
    """One rank's slice of ``bucket`` among ``shards`` as a bucket of its own: what the hook chain reduces across
    the replicas (one flat slot named by the slice's key, ``ceil(numel / shards)`` elements)."""
    size = slice_numel(bucket, shards)
    return Bucket(
        bucket.index, bucket.dtype, bucket.device, (ParamSlot(slice_key(bucket.index), (size,), 0, size),), size
    )


def slice_plan(plan: BucketPlan, shards: int) -> BucketPlan:
    """One rank's slices of every bucket of ``plan`` among ``shards``, as a plan of their own (``slice_bucket``): what
    an outer loop over hybrid-sharded replicas syncs (``fdp.update.zero.replicas``).

    >>> from fdp.plan import pack_into_buckets
    >>> slice_plan(pack_into_buckets([("w", (5,), "float32", "cpu")]), 2).names
    ('bucket0',)
    """
    return BucketPlan([slice_bucket(b, shards) for b in plan.buckets], plan.bucket_cap_mb, plan.first_bucket_cap_mb)


def check_hook_across_nodes(hook: Hook) -> None:
    """Refuse a hook chain that needs the whole reduced bucket: hybrid sharding runs it on each rank's slice.

    >>> from fdp.hooks import powersgd
    >>> check_hook_across_nodes(powersgd())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: hooks 'powersgd' need the whole reduced bucket, which hybrid sharding (world.hierarchical=true ...
    """
    if not hook.shardable:  # PowerSGD's matrices: a node's slice of a bucket cuts through them
        raise ValueError(
            f"hooks {hook_name(hook)!r} need the whole reduced bucket, which hybrid sharding (world.hierarchical=true "
            f"with a ZeRO stage) splits over each node; expected hooks {', '.join(shardable_hooks())}"
        )


def across_replicas(hook: Hook, groups: ShardGroups, plan: BucketPlan) -> Hook:
    """A bucket reduce-scattered inside the group, then its slice reduced by ``hook`` across the replicas.

    ``hook``'s state is made for the slice (``slice_bucket``). The ``comm`` the runtime passes
    carries no data: the bytes sent across the replicas are added to its counters, so a
    step's ``bytes_sent`` is the traffic that leaves the node (as ``fdp.hooks.hierarchical``
    counts it). The result is this rank's slice of the whole world's mean.

    >>> from fdp.hooks import allreduce
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (3,), "float32", "cpu")])
    >>> hook = across_replicas(allreduce(), ShardGroups(Comm(), Comm()), plan)  # one group of one rank
    >>> hook.init(plan.buckets[0]), hook.shardable
    ((), True)
    """
    check_hook_across_nodes(hook)
    shard, replicas = groups.shard, groups.replicas
    inside = ScatterComm(shard, plan)
    shards = shard.world_size

    def init(bucket: Bucket):
        return hook.init(slice_bucket(bucket, shards))

    def apply(state, grads: GradBucket, comm: Comm):
        buffer = grads.buffer if grads.owned else grads.buffer.clone()
        # Dividing first keeps the group's sum in range for low-precision buckets.
        mine = yield inside.sum_bucket(buffer.div_(shards))
        spec = slice_bucket(grads.spec, shards)
        out, state = yield from drive_hook(hook.apply(state, GradBucket(grads.index, mine, spec, owned=True), replicas))
        sent, count = replicas.take_counters()
        comm.bytes_sent += sent
        comm.collectives += count
        if out.buffer.dtype != spec.torch_dtype or out.buffer.numel() != spec.numel:
            raise ValueError(
                f"hybrid sharding: the hook chain must end in the slice's dtype {spec.dtype} and "
                f"{spec.numel} elements, got {out.buffer.dtype} and {out.buffer.numel()}"
            )
        return grads._replace(buffer=out.buffer, owned=True), state

    apply.__qualname__ = getattr(hook.apply, "__qualname__", "across_replicas")  # errors name the user's hook
    return Hook(init, apply, hook.shardable)
