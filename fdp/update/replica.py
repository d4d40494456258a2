"""One replica of an outer loop (``fdp.step.outer``): the ranks that step together between syncs, and the pieces
of the params each of them syncs with the other replicas.

Without ZeRO every rank is a replica of its own: it steps alone and syncs its whole params with every other rank
(this module's ``Replica``). Under hybrid sharding (``world.hierarchical=true`` with a ZeRO stage) a replica is
one group of ``world.node_size`` ranks: its inner steps are ZeRO's inside the group, and each rank syncs its own
slices with the ranks that hold the same slices in the other groups (``fdp.update.zero.replicas``).

>>> import torch
>>> from fdp.plan import pack_into_buckets
>>> replica = Replica(None, pack_into_buckets([("w", (2,), "float32", "cpu")]))
>>> params = {"w": torch.ones(2)}
>>> replica.pieces(params) is params, replica.placed(params, {"w": torch.zeros(2)}, donate=False)["w"].tolist()
(True, [0.0, 0.0])
"""

from __future__ import annotations

from typing import Any

from fdp.comm import Comm
from fdp.model.functional import Params
from fdp.plan import BucketPlan

__all__ = ["Replica"]


class Replica:
    """Every rank a replica of its own (stage 0): ``inner`` is the update of a step inside the replica (``None``:
    the train step's own, stepping alone), ``plan`` the bucket plan of the pieces a rank syncs (its whole params).
    """

    def __init__(self, inner: Any, plan: BucketPlan):
        self.inner, self.plan = inner, plan

    def sync_comm(self, comm: Comm, own_group: bool) -> Comm:
        """The ranks a rank syncs its pieces with, out of the world of ``comm``; ``own_group``: on process groups of
        their own (a sync in flight across steps). Every rank must call it at the same point."""
        return comm.on_own_group() if own_group else comm

    def buffers_comm(self, comm: Comm, sync: Comm) -> Comm:
        """The ranks the buffers (running statistics) are averaged over at a sync: every rank's (``sync`` here)."""
        return sync

    def pieces(self, params: Params) -> Params:
        """What of ``params`` this rank syncs, keyed as ``plan`` names them."""
        return params

    def placed(self, params: Params, pieces: Params, donate: bool) -> Params:
        """``params`` with this rank's synced ``pieces`` put back (a collective inside the replica where the pieces
        are slices of whole params); ``donate``: ``params`` may be overwritten."""
        return pieces
