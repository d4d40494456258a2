"""An outer loop over hybrid-sharded replicas: each group of ``world.node_size`` ranks is one replica.

Under hybrid sharding (``fdp.update.zero.hybrid``) every group holds the same slices, rank ``r`` of each group the
same ones. An outer loop (``fdp.step.outer``) then steps each group on its own between syncs, with the stage's own
update inside the group (its reductions and gathers inside the node, nothing across: ``inner``), and syncs
slice to slice: each rank's pieces are its slices of every bucket (``slice_plan``), the anchor and outer optimizer
state are kept for those slices alone, and a slice's pseudo-gradient is reduced across the ranks that hold it
(``r``, ``r + node_size``, ...). Stage 3's params are those slices already; at stages 1 and 2 they are cut from
the whole params, and after a sync lands the group all-gathers them back into whole params.
"""

from __future__ import annotations

import copy

import torch

from fdp.comm import Alone, Comm
from fdp.model.functional import Params
from fdp.update.replica import Replica
from fdp.update.zero.hybrid import ShardGroups, replica_group, slice_plan
from fdp.update.zero.layout import flats_of, param_views, slice_key, slice_range

__all__ = ["SliceReplica"]


class SliceReplica(Replica):
    """One group of a hybrid-sharded world as an outer loop's replica (see the module docstring).

    ``update``: the hybrid update of stage 1, 2 or 3 (``fdp.update.zero.sliced.SlicedUpdate`` with ``groups``).
    """

    def __init__(self, update):
        groups: ShardGroups = update.groups
        inner = copy.copy(update)
        inner.groups = ShardGroups(groups.shard, Alone())  # the slices' second leg has no other replica to reach
        super().__init__(inner, slice_plan(update.plan, groups.shard.world_size))
        self.whole_plan, self.groups, self.sliced = update.plan, groups, update.rules.shards_params

    def sync_comm(self, comm: Comm, own_group: bool) -> Comm:
        # The replica groups are made anew, every rank making every one, as hybrid sharding made them.
        return (
            replica_group(self.groups.shard.world_size, self.groups.replicas.watch)
            if own_group
            else self.groups.replicas
        )

    def buffers_comm(self, comm: Comm, sync: Comm) -> Comm:
        return comm  # the ranks of a group stepped on their own batches: every rank's buffers are averaged

    def _ranges(self) -> list[tuple[int, int]]:
        shard = self.groups.shard
        return [slice_range(b, shard.rank, shard.world_size) for b in self.whole_plan.buckets]

    def pieces(self, params: Params) -> Params:
        if self.sliced:  # stage 3: the params are this rank's slices
            return params
        flats = flats_of(params, self.whole_plan, self.groups.shard.world_size, copy=False)
        return {
            slice_key(b.index): flat[slice(*r)] for b, flat, r in zip(self.whole_plan.buckets, flats, self._ranges())
        }

    def placed(self, params: Params, pieces: Params, donate: bool) -> Params:
        if self.sliced:
            return pieces
        shard = self.groups.shard
        flats = flats_of(params, self.whole_plan, shard.world_size, copy=not donate)
        pending = []
        for bucket, flat, (start, stop) in zip(self.whole_plan.buckets, flats, self._ranges()):
            mine, piece = flat[start:stop], pieces[slice_key(bucket.index)]
            if piece.data_ptr() != mine.data_ptr():
                with torch.no_grad():
                    mine.copy_(piece)
            pending.append(shard.all_gather_into(flat, mine))  # the group's slices, into every rank's whole params
        for each in pending:
            each.wait()
        return param_views(self.whole_plan, flats, list(params))
