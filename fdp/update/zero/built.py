"""ZeRO stage 3's first state made slice by slice: no rank ever holds the whole params.

Where the model was built on ``meta`` (``fdp.model.deferred``), each parameter can be made
on its own, with the values a whole build gives it. ``owned_slices`` makes, one at a
time, only the parameters that overlap this rank's slice of some bucket
(``fdp.update.zero.layout``), copies the overlap into that slice and drops the rest, so
a rank's peak is its slices plus one parameter. The slices are those
``fdp.update.zero.convert.init_state(..., stage=3)`` cuts from the whole params: a stage-3
run starts from exactly the params of a stage-0 run of the same seed, at any world size.

>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([("a", (3,), "float32", "cpu"), ("b", (2,), "float32", "cpu")])
>>> whole = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([4.0, 5.0])}
>>> made = []
>>> owned_slices(lambda name: made.append(name) or whole[name], plan, rank=1, world=2)
{'bucket0': tensor([4., 5., 0.])}
>>> made  # "a" lies wholly in rank 0's slice: never made on rank 1
['b']
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fdp.comm import Comm
from fdp.hooks import Hook, allreduce, init_hook_states
from fdp.model.functional import Buffers
from fdp.optim import GradientTransformation
from fdp.plan import BucketPlan
from fdp.state.replicas import agreed_start, rank_seed
from fdp.state.train_state import TrainState
from fdp.update.zero.convert import mirrors
from fdp.update.zero.layout import slice_key, slice_range

__all__ = ["owned_slices", "sliced_first_state"]


def owned_slices(
    make: Callable[[str], torch.Tensor], plan: BucketPlan, rank: int, world: int
) -> dict[str, torch.Tensor]:
    """This rank's slice of every bucket (zero past the bucket's end), each parameter made by ``make(name)``
    (whole, any device) only where it overlaps the slice, and dropped once its overlap is copied."""
    ranges = [slice_range(bucket, rank, world) for bucket in plan.buckets]
    # Every slice first: the params made one by one after them come and go above what the rank keeps.
    slices = {
        slice_key(b.index): torch.zeros(stop - start, dtype=b.torch_dtype, device=b.device)
        for b, (start, stop) in zip(plan.buckets, ranges)
    }
    for bucket, (start, stop) in zip(plan.buckets, ranges):
        piece = slices[slice_key(bucket.index)]
        for slot in bucket.slots:
            low, high = max(start, slot.offset), min(stop, slot.offset + slot.numel)
            if low >= high:
                continue
            whole = make(slot.name).reshape(-1)
            with torch.no_grad():
                piece[low - start : high - start].copy_(whole[low - slot.offset : high - slot.offset])
            del whole
    return slices


def sliced_first_state(
    make: Callable[[str], torch.Tensor],
    buffers: Buffers,
    optimizer: GradientTransformation,
    plan: BucketPlan,
    comm: Comm,
    hook: Hook | None = None,
    seed: int = 0,
    mirror: bool = False,
    precision: Any = None,
    shard: Comm | None = None,
) -> TrainState:
    """The stage-3 state before step 1 from params made one at a time (``make(name)``, the same on every rank):
    the ranks' plans, seeds and buffers compared and rank 0's buffers taken, as every stage starts, and only
    this rank's slices of the params kept (split over ``shard``, this rank's group under hybrid sharding;
    by default over ``comm``; ``precision``: the loss scale of ``16-mixed``, as ``init_state``)."""
    mirrors(mirror, 3, comm.world_size)  # refused at stage 3
    _, buffers = agreed_start({}, buffers, plan, comm, seed)
    shard = shard or comm
    slices = owned_slices(make, plan, shard.rank, shard.world_size)
    hook_state = init_hook_states(hook or allreduce(), plan)
    rng = torch.Generator().manual_seed(rank_seed(seed, comm.rank)).get_state()
    loss_scale = precision.init_loss_scale(plan.buckets[0].device) if precision is not None else None
    return TrainState(0, slices, buffers, optimizer.init(slices), hook_state, rng, loss_scale=loss_scale)
