"""What the update of every ZeRO stage (1, 2 and 3) does the same with its state's life.

The first state is made as stage 0 makes it (the ranks' plans, seeds and buffers
compared, rank 0's params and buffers taken), then sharded for the stage without ever
building the whole optimizer state (``fdp.update.zero.convert.init_state``). A checkpoint holds
the whole state, gathered to rank 0 (``gather_state``), so that any stage and world size
resumes it (``shard_state``). After ranks were lost only stage 1, whose ranks each keep
the next rank's slices (``mirror``), can go on (``fdp.update.zero.mirror``), or, at every
stage, a hybrid world, whose groups leave whole (``fdp.procs.shrink.whole_groups``): each group
left holds every slice already.

With ``groups`` (hybrid sharding, ``fdp.update.zero.hybrid``) the state is split over this
rank's group, not the world: ``comm`` is the group's, the reduction hands each rank its slice
at every stage (``across_replicas``), a whole-file checkpoint is gathered inside group 0 and
a sharded one has its slices written by group 0 alone (every group holds the same ones). Under an outer loop the
groups step apart between syncs (``fdp.update.zero.replicas``): every group gathers its whole state, outer state
included (``gather_outer``), and each rank saves its group's, as each rank of a stage-0 outer loop saves its own.
"""

from __future__ import annotations

from typing import Any

from fdp.comm import Comm
from fdp.hooks import Hook, allreduce
from fdp.model.functional import Buffers, Params
from fdp.optim import GradientTransformation
from fdp.plan import BucketPlan
from fdp.state.replicas import agreed_start, rank_seed
from fdp.state.train_state import TrainState
from fdp.trace import NullTimeline, Timeline
from fdp.update.base import Update
from fdp.update.pieces import SliceRange, state_pieces
from fdp.update.replica import Replica
from fdp.update.zero.convert import (
    gather_outer,
    gather_state,
    init_state,
    outer_template,
    params_sharded,
    shard_outer,
    shard_state,
    unsharded_template,
)
from fdp.update.zero.decay import sliced_optimizer
from fdp.update.zero.hybrid import ShardGroups, across_replicas, refuses_outer
from fdp.update.zero.layout import slice_range
from fdp.update.zero.mirror import reshard_survivors
from fdp.update.zero.replicas import SliceReplica

__all__ = ["SlicedUpdate"]


class SlicedUpdate(Update):
    """The state's life at ZeRO stages 1 to 3 (see the module docstring); the steps are the subclasses'.

    ``mirror``: the state keeps the next rank's slices of the optimizer state too
    (``TrainState.mirror``, a world that may shrink), where the stage can
    (``Stage.refuses_mirror``). ``groups``: the state is sharded inside this rank's group and
    replicated across the groups (see the module docstring); ``comm`` is then the group's.
    """

    def __init__(
        self,
        optimizer: GradientTransformation,
        plan: BucketPlan,
        comm: Comm,
        stage: int,
        timeline: Timeline | None = None,
        donate: bool = False,
        early: bool = False,
        mirror: bool = False,
        groups: ShardGroups | None = None,
    ):
        self.optimizer, self.plan, self.stage, self.groups = optimizer, plan, stage, groups
        self.comm = comm if groups is None else groups.shard  # the ranks a bucket is split over
        self.timeline = timeline or NullTimeline()
        self.donate, self.early = donate, early
        self.mirror = mirror  # refused, where the stage cannot keep one, by the state it makes
        # The optimizer as it steps this rank's slices (and a mirror's, the next rank's): a weight-decay rule by
        # name becomes each slice's runs, worked out once, here (fdp.update.zero.decay).
        rank, world = self.comm.rank, self.comm.world_size  # the group's, under hybrid sharding
        self.slice_optimizer = sliced_optimizer(optimizer, plan, rank, world)
        self.mirror_optimizer = sliced_optimizer(optimizer, plan, (rank + 1) % world, world)

    @property
    def scattered(self) -> bool:
        """Whether the reduction hands each rank only its slice of a bucket (stages 2 and 3; every stage of a hybrid
        world)."""
        return self.rules.scatters or self.groups is not None

    def reduction_hook(self, hook: Hook) -> Hook:
        return hook if self.groups is None else across_replicas(hook, self.groups, self.plan)

    def _shard_comm(self, comm: Comm) -> Comm:
        """The comm a state is split over: ``comm`` (the world's) or, hybrid, this rank's group."""
        return comm if self.groups is None else self.groups.shard

    def first_state(
        self, params: Params, buffers: Buffers, hook: Hook | None, comm: Comm, seed: int = 0, precision: Any = None
    ) -> TrainState:
        params, buffers = agreed_start(params, buffers, self.plan, comm, seed)
        return init_state(
            params,
            buffers,
            self.optimizer,
            self.plan,
            self._shard_comm(comm),
            self.reduction_hook(hook or allreduce()),
            seed=rank_seed(seed, comm.rank),
            stage=self.stage,
            mirror=self.mirror,
            precision=precision,
        )

    def to_checkpoint(self, state: TrainState, comm: Comm) -> TrainState:
        shard = self._shard_comm(comm)
        if state.outer:  # replicas step apart between syncs: each rank saves its group's whole state (as stage 0's)
            whole = gather_state(state, self.plan, shard)
            return whole._replace(outer=gather_outer(state.outer, self.plan, shard, self._model_order(state)))
        if self.groups is not None and self.groups.replicas.rank != 0:
            return state  # group 0 holds every slice as well: only it gathers, to world rank 0
        return gather_state(state, self.plan, shard, to=0)

    def checkpoint_template(self, state: TrainState) -> TrainState:
        template = unsharded_template(state, self.optimizer, self.plan)
        return template._replace(outer=outer_template(state.outer, self.plan, self._model_order(state)))

    def _model_order(self, state: TrainState) -> list[str]:
        """The params in the model's order, a stage-0 state's (the params' own, or at stage 3 the model's)."""
        if not params_sharded(state.params, self.plan):
            return list(state.params)
        model = getattr(self, "model", None)
        return [name for name, _ in model.module.named_parameters()] if model is not None else list(self.plan.names)

    def from_checkpoint(self, whole: TrainState, comm: Comm) -> TrainState:
        shard = self._shard_comm(comm)
        state = shard_state(whole, self.plan, shard, self.stage, mirror=self.mirror)
        return state._replace(outer=shard_outer(whole.outer, self.plan, shard))

    def slice_range(self, comm: Comm) -> SliceRange:
        buckets, shard = self.plan.buckets, self._shard_comm(comm)
        return lambda index: slice_range(buckets[index], shard.rank, shard.world_size)

    def checkpoint_pieces(self, tree: dict, comm: Comm, reading: bool = False) -> tuple[dict, dict]:
        if reading or self.groups is None or self.groups.replicas.rank == 0:
            return super().checkpoint_pieces(tree, comm, reading)
        # Another group's slices are group 0's: written once, by it. Whole tensors are split over the world.
        return state_pieces(tree, self.plan, comm.rank, comm.world_size, lambda index: (0, 0))

    def replica(self) -> Replica:
        """One group of a hybrid world (``fdp.update.zero.replicas``); a flat world is refused (``refuses_outer``)."""
        reason = refuses_outer(self.stage, self.groups is not None)
        if reason:
            raise ValueError(
                f"zero_stage={self.stage}: expected world.hierarchical=true under an outer loop ({reason})"
            )
        return SliceReplica(self)

    def reshard(
        self, state: TrainState, old_members: tuple[int, ...], new_members: tuple[int, ...], comm: Comm
    ) -> TrainState:
        if self.groups is not None:  # whole groups left or joined (fdp.procs.shrink.whole_groups): the same slices
            return state
        reason = self.rules.refuses_mirror()
        if reason:
            raise ValueError(f"zero_stage={self.stage}: cannot go on without a lost rank ({reason})")
        return reshard_survivors(state, self.plan, old_members, new_members, comm)
