"""Sharded data parallel on the bucket plan (ZeRO): stages 1, 2 and 3.

Every rank owns an equal slice of each bucket's flat layout (``fdp.zero.layout``) and
steps only that slice:

* stage 1 shards the optimizer state: gradients are all-reduced as at stage 0, each rank
  steps its slice of the params and all-gathers it into every rank's whole params;
* stage 2 shards the reduced gradients too: the hook chain reduce-scatters each bucket
  (``fdp.zero.scatter``), so a rank receives only its slice, and the bucket buffers are
  released between steps (``fdp.zero.sharded``);
* stage 3 shards the params too: between steps a rank holds nothing whole, and each
  bucket's params are all-gathered while forward and backward read them
  (``fdp.zero.gather``, ``fdp.zero.params``).

Each stage is an ``fdp.update.Update`` (``make_update``); the train step is the same for
all. In a world that may shrink, stage 1 also keeps the next rank's slices of the
optimizer state (``TrainState.mirror``), and ``reshard_survivors`` splits the state
again over the ranks left (``fdp.zero.mirror``). Checkpoints hold the whole state (``gather_state``), so any world size and any
stage can resume them (``shard_state``; ``fdp.zero.convert``).

>>> check_zero_stage(1)
1
"""
from __future__ import annotations

from typing import Any

from fdp.comm import Comm
from fdp.functional import FunctionalModel
from fdp.hooks import Hook, stage_name
from fdp.optim import GradientTransformation
from fdp.plan import BucketPlan
from fdp.state import state_nbytes
from fdp.trace import Timeline
from fdp.update import ReplicatedUpdate
from fdp.zero.convert import (
    gather_state,
    init_state,
    is_sharded,
    params_sharded,
    shard_state,
    unsharded_template,
    whole_params,
)
from fdp.zero.layout import shard_key, shard_range
from fdp.zero.mirror import LostSlices, reshard_survivors
from fdp.zero.params import ParamShardedUpdate
from fdp.zero.sharded import ShardedUpdate

__all__ = [
    "ZERO_STAGES", "check_zero_stage", "check_hook_for_stage", "check_optimizer_for_stage", "make_update", "scatters",
    "shard_range", "shard_key", "init_state",
    "shard_state", "gather_state", "whole_params", "unsharded_template", "is_sharded", "params_sharded", "state_nbytes",
    "ShardedUpdate", "ParamShardedUpdate", "LostSlices", "reshard_survivors",
]

ZERO_STAGES = (0, 1, 2, 3)
# Stages whose reduction hands each rank its slice of the bucket alone.
_SCATTERING = (2, 3)


def check_zero_stage(stage: Any) -> int:
    """``zero_stage``: 0 (every rank holds everything), 1 (shard optimizer state), 2 (and gradients) or 3 (and params).

    >>> check_zero_stage(4)
    Traceback (most recent call last):
    ...
    ValueError: zero_stage=4: expected 0, 1, 2 or 3
    """
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={stage!r}: expected 0, 1, 2 or 3")
    return stage


def check_hook_for_stage(stage: int, hook: Hook) -> None:
    """Refuse a hook chain that needs the whole reduced bucket under a stage that scatters it.

    What a hook needs is declared once, on the hook (``Hook.shardable``).

    >>> from fdp.hooks import powersgd
    >>> check_hook_for_stage(2, powersgd())
    Traceback (most recent call last):
    ...
    ValueError: zero_stage=2: hooks 'powersgd' need the whole reduced bucket, which stage 2 scatters; expected hooks allreduce, fp16, bf16, int8 or noop (or zero_stage=1)
    """
    if stage in _SCATTERING and not hook.shardable:
        raise ValueError(
            f"zero_stage={stage}: hooks {stage_name(hook)!r} need the whole reduced bucket, which stage {stage} scatters; "
            "expected hooks allreduce, fp16, bf16, int8 or noop (or zero_stage=1)"
        )


def check_optimizer_for_stage(stage: int, optimizer: GradientTransformation) -> None:
    """Refuse an optimizer whose step depends on parameter names (``by_name``: a weight-decay mask) at a ZeRO stage,
    which steps flat slices of buckets that mix parameters.

    >>> from fdp.optim import adamw, decay_rule
    >>> check_optimizer_for_stage(1, adamw(1e-3, decay_mask=decay_rule("weights")))
    Traceback (most recent call last):
    ...
    ValueError: zero_stage=1: the optimizer exempts params from weight decay by name, which ZeRO's flat slices of buckets do not keep; expected zero_stage=0 (or optim.decay_filter=all)
    """
    if stage and optimizer.by_name:
        raise ValueError(
            f"zero_stage={stage}: the optimizer exempts params from weight decay by name, which ZeRO's flat slices "
            "of buckets do not keep; expected zero_stage=0 (or optim.decay_filter=all)"
        )


def scatters(stage: int) -> bool:
    """Whether stage ``stage``'s reduction hands each rank only its slice of a bucket.

    >>> [scatters(stage) for stage in ZERO_STAGES]
    [False, False, True, True]
    """
    return stage in _SCATTERING


def make_update(
    stage: int, optimizer: GradientTransformation, plan: BucketPlan, comm: Comm, timeline: Timeline | None = None,
    donate: bool = False, early: bool = False, model: FunctionalModel | None = None,
    reshard_after_forward: bool = True,
) -> Any:
    """The ``fdp.update.Update`` of ZeRO stage ``stage`` (0 is the replicated update).

    ``early`` allows an elementwise optimizer to step each bucket as soon as its
    reduction is done (see ``fdp.update.ReplicatedUpdate``). Stage 3 gathers the params
    of ``model`` bucket by bucket (``fdp.zero.gather``).
    """
    check_zero_stage(stage)
    check_optimizer_for_stage(stage, optimizer)
    if stage == 0:
        return ReplicatedUpdate(optimizer, plan, comm, timeline, donate, early)
    if stage == 3:
        return ParamShardedUpdate(optimizer, plan, comm, model, reshard_after_forward, timeline, donate, early)
    return ShardedUpdate(optimizer, plan, comm, stage, timeline, donate, early)
