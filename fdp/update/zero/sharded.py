"""ZeRO stages 1 and 2: each rank steps its slice of every bucket, then the slices are all-gathered.

* Stage 1: gradients are reduced as at stage 0 (the hook chain all-reduces each
  bucket); each rank steps only its slice of the params, with optimizer state for that
  slice alone, and all-gathers the updated slice into every rank's whole params.
* Stage 2: the reduction reduce-scatters each bucket instead (``ScatterComm``), so a
  rank receives only its slice of the averaged gradient, and the reduction releases each
  bucket buffer as its chain finishes (``GradReducer(release_buffers=True)``).

A bucket's update and all-gather start as soon as its reduction has finished, while
later buckets are still on the wire; the all-gathers are awaited at the end of the step.

A stage-1 state with a ``mirror`` (``TrainState.mirror``: a world that may shrink) also
steps the next rank's slices of the optimizer state, from the whole reduced gradient
every rank holds at stage 1 and the cross-rank sums of its own update (a clipping
norm) replayed: no communication, the optimizer's elementwise work twice.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fdp.comm import Comm, Pending
from fdp.optim import GradientTransformation, apply_gradients
from fdp.plan import BucketPlan
from fdp.state.checks import check_same_replicas, check_state_against_plan
from fdp.trace import Timeline
from fdp.update.zero.convert import is_sharded
from fdp.update.zero.hybrid import ShardGroups
from fdp.update.zero.layout import flats_of, padded_slice, param_views, slice_key, slice_range
from fdp.update.zero.scatter import ScatterComm
from fdp.update.zero.slice_step import SliceStep
from fdp.update.zero.sliced import SlicedUpdate

__all__ = ["ShardedUpdate"]


class ShardedUpdate(SlicedUpdate):
    """The ``fdp.update.base.Update`` of ZeRO stages 1 and 2 (see the module docstring)."""

    flat_params = False

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
        if stage not in (1, 2):
            raise ValueError(f"stage={stage!r}: expected 1 or 2 (stage 0 is fdp.update.base.ReplicatedUpdate)")
        super().__init__(optimizer, plan, comm, stage, timeline, donate, early, mirror, groups)

    def for_step(
        self, comm: Comm, timeline: Timeline | None = None, donate: bool = False, early: bool = False
    ) -> "ShardedUpdate":
        return ShardedUpdate(
            self.optimizer, self.plan, comm, self.stage, timeline, donate, early, self.mirror, self.groups
        )

    def reduction_comm(self, comm: Comm) -> Any:
        # Hybrid: the chain reduces across the replicas inside reduction_hook; the runtime's comm counts its bytes.
        return ScatterComm(comm, self.plan) if self.rules.scatters and self.groups is None else comm

    def check_state(self, state: Any) -> None:
        check_state_against_plan(state, self.plan)
        check_same_replicas(state.params, state.buffers, self.comm, fresh=state.step == 0)
        if not is_sharded(state.opt_state, self.plan):
            raise ValueError(
                f"zero_stage={self.stage}: the optimizer state is not sharded; "
                "build the state with fdp.update.zero.init_state or fdp.update.zero.shard_state"
            )
        reason = self.rules.refuses_mirror() if state.mirror else None
        if reason:
            raise ValueError(
                f"zero_stage={self.stage}: a state with a mirror of the next rank's slices ({reason}); "
                "expected one without (mirror=False)"
            )

    def begin(self, state: Any, grad_buffers: tuple[torch.Tensor, ...]) -> "_ShardedStep":
        # A mirror steps from the params the step began with: no slice is stepped (and gathered) early.
        # An elementwise optimizer without an in-place form (a user's own) steps once every slice is in.
        per_bucket = (
            self.early
            and state.loss_scale is None
            and self.optimizer.elementwise
            and not state.mirror
            and self.optimizer.update_inplace is not None
        )
        return _ShardedStep(self, state, grad_buffers, per_bucket)


class _ShardedStep(SliceStep):
    def __init__(self, owner: ShardedUpdate, state: Any, grad_buffers: tuple[torch.Tensor, ...], per_bucket: bool):
        super().__init__(owner, sliced=owner.scattered)
        self.state, self.grad_buffers, self.per_bucket = state, grad_buffers, per_bucket
        plan = owner.plan
        # A step that may not touch ``state`` (donate=False) works on copies of the params.
        self.flats = flats_of(state.params, plan, self.world, copy=not owner.donate)
        self.params = dict(state.params) if owner.donate else param_views(plan, self.flats, list(state.params))
        self.ranges = [slice_range(b, self.rank, self.world) for b in plan.buckets]
        self.grads: dict[str, torch.Tensor] = {}
        self.gathers: list[Pending] = []
        self.opt_state = state.opt_state
        self.mirror = state.mirror
        mirrored = (self.rank + 1) % self.world
        self.mirror_ranges = [slice_range(b, mirrored, self.world) for b in plan.buckets] if state.mirror else []
        self.mirror_grads: dict[str, torch.Tensor] = {}
        self.sums: list[torch.Tensor] = []  # what _sum_across returned, for the mirror's update

    def _param_slices(self, indices, ranges=None) -> dict[str, torch.Tensor]:
        ranges = ranges or self.ranges
        return {slice_key(i): self.flats[i][slice(*ranges[i])] for i in indices}

    def reduced(self, index: int, buffer: torch.Tensor) -> None:
        """Take bucket ``index``'s reduced gradient; step and gather its slice now where allowed."""
        owner = self.owner
        bucket = owner.plan.buckets[index]
        start, stop = self.ranges[index]
        # A scattering chain hands back this rank's slice of the sum (for a bucket of one element, a slice as
        # long as the bucket: taken as the slice, which a chain's sum_bucket gives); one that sends nothing, the whole.
        if owner.scattered and buffer.numel() == stop - start:
            grad = buffer
            self.take(index, grad, grad)
        elif buffer.numel() == bucket.numel:  # the whole bucket (stage 1, or a chain that sends nothing)
            grad = padded_slice(buffer, start, stop)
            self.take(index, buffer, grad if self.sliced else buffer)  # each rank counts its slice where they add up
        else:
            raise ValueError(
                f"zero_stage={owner.stage}: the hook chain returned {buffer.numel()} elements for bucket {index} "
                f"of {bucket.numel}; expected the whole bucket or this rank's slice of {stop - start}"
            )
        if self.mirror_ranges:
            self.mirror_grads[slice_key(index)] = padded_slice(buffer[: bucket.numel], *self.mirror_ranges[index])
        if self.per_bucket:
            with owner.timeline.span("optimizer", bucket=index):
                self.opt_state = owner.slice_optimizer.update_inplace(
                    {slice_key(index): grad}, self.state.opt_state, self._param_slices([index])
                )
            self._gather(index)
        else:
            self.grads[slice_key(index)] = grad

    def _gather(self, index: int) -> None:
        start, stop = self.ranges[index]
        # The updated slice already sits in its place in the flat buffer: gathered in place.
        self.gathers.append(self.owner.comm.all_gather_into(self.flats[index], self.flats[index][start:stop]))

    def finish(self) -> tuple[dict, Any]:
        """Step the slices not stepped yet, wait for every all-gather; ``(params, opt_state)``."""
        owner = self.owner
        if self.grads:
            indices = [b.index for b in owner.plan.buckets]
            slices = self._param_slices(indices)
            with owner.timeline.span("optimizer"):
                new_slices, self.opt_state = apply_gradients(
                    owner.slice_optimizer,
                    self.grads,
                    self.state.opt_state,
                    slices,
                    donate=owner.donate,
                    sum_across=self._sum_across,
                )
                if self.mirror_ranges:  # before the gathers overwrite the next rank's slices of the params
                    self.mirror = self._step_mirror(indices)
            for index in indices:
                key = slice_key(index)
                if new_slices[key] is not slices[key]:
                    with torch.no_grad():
                        slices[key].copy_(new_slices[key])
                self._gather(index)
        t0 = time.perf_counter()
        for pending in self.gathers:
            pending.wait()
        self.wait_s += time.perf_counter() - t0
        return self.params, self.opt_state

    def _sum_across(self, tensor: torch.Tensor) -> torch.Tensor:
        total = super()._sum_across(tensor)
        self.sums.append(total)
        return total

    def _step_mirror(self, indices) -> Any:
        """The next rank's slices of the optimizer state, stepped as that rank steps them (never in place)."""
        sums = iter(self.sums)
        params = self._param_slices(indices, self.mirror_ranges)  # still the values the step began with
        _, mirror = apply_gradients(
            self.owner.mirror_optimizer,
            self.mirror_grads,
            self.state.mirror,
            params,
            sum_across=lambda tensor: next(sums),
        )
        return mirror
