"""Sharded data parallel on the bucket plan (ZeRO): stages 1, 2 and 3.

Every rank owns an equal slice of each bucket's flat layout (``fdp.update.zero.layout``) and
steps only that slice:

* stage 1 shards the optimizer state: gradients are all-reduced as at stage 0, each rank
  steps its slice of the params and all-gathers it into every rank's whole params;
* stage 2 shards the reduced gradients too: the hook chain reduce-scatters each bucket
  (``fdp.update.zero.scatter``), so a rank receives only its slice, and the bucket buffers are
  released between steps (``fdp.update.zero.sharded``);
* stage 3 shards the params too: between steps a rank holds nothing whole, and each
  bucket's params are all-gathered while forward and backward read them
  (``fdp.update.zero.gather``, ``fdp.update.zero.params``); from a model built on ``meta``
  its first state is made slice by slice, never whole (``fdp.update.zero.built``).

Each stage is an ``fdp.update.base.Update``, made once from the stage's number by
``update_for``: the train step is the same for all, and the trainer asks the update, not
the number, how the state starts, what a checkpoint holds (the whole state,
``gather_state``, so any world size and stage can resume it: ``shard_state``;
``fdp.update.zero.convert``), and how it goes on after ranks were lost. In a world that may
shrink, stage 1 also keeps the next rank's slices of the optimizer state
(``TrainState.mirror``), and ``reshard_survivors`` splits the state again over the ranks
left (``fdp.update.zero.mirror``). With ``world.hierarchical`` the state is sharded inside each
node's group and replicated across the nodes (hybrid sharding, ``fdp.update.zero.hybrid``); an outer loop
then syncs the groups as its replicas, slice to slice (``fdp.update.zero.replicas``).
What each stage accepts is stated once, in ``fdp.update.base.STAGES``.

>>> check_zero_stage(1)
1
"""

from __future__ import annotations

from typing import Any

from fdp.comm import Comm
from fdp.errors import check_choice
from fdp.model.functional import FunctionalModel
from fdp.optim import GradientTransformation
from fdp.plan import BucketPlan
from fdp.state.train_state import state_nbytes
from fdp.trace import Timeline
from fdp.update.base import STAGES, ReplicatedUpdate, Stage, Update
from fdp.update.zero.convert import (
    gather_state,
    init_state,
    is_sharded,
    params_sharded,
    shard_state,
    unsharded_template,
    whole_params,
)
from fdp.update.zero.hybrid import (
    ShardGroups,
    across_replicas,
    check_hook_across_nodes,
    refuses_outer,
    shard_groups,
    slice_plan,
)
from fdp.update.zero.layout import padded_slice, slice_key, slice_range
from fdp.update.zero.mirror import LostSlices, reshard_survivors
from fdp.update.zero.params import ParamShardedUpdate
from fdp.update.zero.sharded import ShardedUpdate

__all__ = [
    "ZERO_STAGES",
    "Stage",
    "check_zero_stage",
    "stage_rules",
    "check_optimizer_for_stage",
    "update_for",
    "scatters",
    "slice_range",
    "slice_key",
    "padded_slice",
    "init_state",
    "shard_state",
    "gather_state",
    "whole_params",
    "unsharded_template",
    "is_sharded",
    "params_sharded",
    "state_nbytes",
    "ShardedUpdate",
    "ParamShardedUpdate",
    "LostSlices",
    "reshard_survivors",
    "ShardGroups",
    "shard_groups",
    "across_replicas",
    "check_hook_across_nodes",
    "refuses_outer",
    "slice_plan",
]

ZERO_STAGES = tuple(stage.number for stage in STAGES)


def check_zero_stage(stage: Any) -> int:
    """``zero_stage``: 0 (every rank holds everything), 1 (shard optimizer state), 2 (and gradients) or 3 (and params).

    >>> check_zero_stage(4)
    Traceback (most recent call last):
    ...
    ValueError: zero_stage=4: expected 0, 1, 2 or 3
    """
    return check_choice("zero_stage", stage, ZERO_STAGES)


def stage_rules(stage: int) -> Stage:
    """What stage ``stage`` shards and accepts (``fdp.update.base.Stage``), for a check made before any update exists.

    >>> stage_rules(3).shards_params
    True
    """
    return STAGES[check_zero_stage(stage)]


def check_optimizer_for_stage(stage: int, optimizer: GradientTransformation) -> None:
    """Refuse, naming the stage, an optimizer the stage cannot step (``Stage.refuses_optimizer``).

    >>> from fdp.optim import GradientTransformation, adamw, decay_rule
    >>> check_optimizer_for_stage(1, adamw(1e-3, decay_mask=decay_rule("weights")))  # steps its slices' runs
    >>> check_optimizer_for_stage(1, GradientTransformation(lambda p: (), lambda g, s, p: (g, s)))
    Traceback (most recent call last):
    ...
    ValueError: zero_stage=1: ZeRO stage 1 steps a shard of the gradients, which needs an update that takes sum_across=
    """
    reason = stage_rules(stage).refuses_optimizer(optimizer)
    if reason:
        raise ValueError(f"zero_stage={stage}: {reason}")


def scatters(stage: int) -> bool:
    """Whether stage ``stage``'s reduction hands each rank only its slice of a bucket.

    >>> [scatters(stage) for stage in ZERO_STAGES]
    [False, False, True, True]
    """
    return stage_rules(stage).scatters


def update_for(
    stage: int,
    optimizer: GradientTransformation,
    plan: BucketPlan,
    comm: Comm,
    timeline: Timeline | None = None,
    donate: bool = False,
    early: bool = False,
    model: FunctionalModel | None = None,
    reshard_after_forward: bool = True,
    mirror: bool = False,
    gather_dtype: Any = None,
    groups: ShardGroups | None = None,
) -> Update:
    """The ``fdp.update.base.Update`` of ZeRO stage ``stage`` (0 is the replicated update): the one place a stage's
    number becomes its update.

    ``early`` allows an elementwise optimizer to step each bucket as soon as its
    reduction is done (see ``fdp.update.base.ReplicatedUpdate``). Stage 3 gathers the params
    of ``model`` bucket by bucket (``fdp.update.zero.gather``). ``mirror``: the states it makes
    keep the next rank's slices too (stage 1, a world that may shrink; stage 0 holds
    everything already). ``gather_dtype``: the dtype stage 3 gathers params in
    (``Precision.gather_dtype``; ``None``: the buckets' own). ``groups``: hybrid sharding, the state sharded
    inside this rank's group and replicated across the groups (``fdp.update.zero.hybrid``; stages 1-3).

    >>> from fdp import sgd
    >>> from fdp.plan import pack_into_buckets
    >>> update = update_for(1, sgd(0.1), pack_into_buckets([("w", (3,), "float32", "cpu")]), Comm())
    >>> update.stage, update.release_buffers
    (1, False)
    """
    check_zero_stage(stage)
    check_optimizer_for_stage(stage, optimizer)
    if stage == 0:
        if groups is not None:
            raise ValueError("groups: expected None at zero_stage=0 (nothing is sharded to split over a group)")
        return ReplicatedUpdate(optimizer, plan, comm, timeline, donate, early)
    if stage == 3:
        return ParamShardedUpdate(
            optimizer, plan, comm, model, reshard_after_forward, timeline, donate, early, mirror, gather_dtype, groups
        )
    return ShardedUpdate(optimizer, plan, comm, stage, timeline, donate, early, mirror, groups)
