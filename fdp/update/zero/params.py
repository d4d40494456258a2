"""ZeRO stage 3: params sharded too. Each rank keeps its slice of every bucket and nothing whole.

``TrainState.params`` holds ``{"bucket<i>": slice}`` (``fdp.update.zero.convert``), the
optimizer state the same slices' state. A step gathers each bucket's params while the
forward and backward need them (``fdp.update.zero.gather.ParamGather``), the hook chain
reduce-scatters each bucket's gradient as soon as it is complete (``ScatterComm``, as at
stage 2), and each rank steps its slices with its slices of the gradient. Nothing is
all-gathered after the optimizer: the next step's forward gathers what it reads.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from fdp._torch import HAS_DISABLE_FUNCTORCH
from fdp.comm import Comm
from fdp.errors import require
from fdp.hooks import Hook, allreduce
from fdp.model.functional import Buffers, FunctionalModel, Params
from fdp.optim import GradientTransformation, apply_gradients
from fdp.plan import BucketPlan
from fdp.state.checks import check_same_replicas
from fdp.state.train_state import TrainState
from fdp.trace import Timeline
from fdp.update.zero.built import sliced_first_state
from fdp.update.zero.convert import is_sharded, params_sharded
from fdp.update.zero.gather import ParamGather
from fdp.update.zero.hybrid import ShardGroups
from fdp.update.zero.layout import padded_slice, slice_key, slice_range
from fdp.update.zero.scatter import ScatterComm
from fdp.update.zero.slice_step import SliceStep
from fdp.update.zero.sliced import SlicedUpdate

__all__ = ["ParamShardedUpdate"]


class ParamShardedUpdate(SlicedUpdate):
    """The ``fdp.update.base.Update`` of ZeRO stage 3 (see the module docstring).

    ``model`` is the ``FunctionalModel`` the loss runs: its modules' hooks gather each
    bucket before its params are read. ``gather`` is handed to the ``GradReducer``; it is
    made (and the hooks registered) when first asked for, by the train step. ``gather_dtype``
    (``Precision.gather_dtype``, bfloat16 under ``bf16-mixed``): the dtype the params are
    gathered and read in, FSDP2's ``param_dtype``; the slices the optimizer steps stay in
    the buckets' own dtype.
    """

    flat_params = False

    def __init__(
        self,
        optimizer: GradientTransformation,
        plan: BucketPlan,
        comm: Comm,
        model: FunctionalModel | None,
        reshard_after_forward: bool = True,
        timeline: Timeline | None = None,
        donate: bool = False,
        early: bool = False,
        mirror: bool = False,
        gather_dtype: torch.dtype | None = None,
        groups: ShardGroups | None = None,
    ):
        require(
            isinstance(model, FunctionalModel),
            "model",
            model,
            "the FunctionalModel the loss runs (fdp.functionalize), which zero_stage=3 gathers bucket by bucket",
            TypeError,
        )
        require(HAS_DISABLE_FUNCTORCH, "zero_stage", 3, "0, 1 or 2: this torch cannot leave torch.func from a hook")
        super().__init__(optimizer, plan, comm, 3, timeline, donate, early, mirror, groups)
        self.model, self.reshard_after_forward, self.gather_dtype = model, reshard_after_forward, gather_dtype
        self._gather: ParamGather | None = None

    @property
    def gather(self) -> ParamGather:
        if self._gather is None:
            self._gather = ParamGather(
                self.model, self.plan, self.comm, self.reshard_after_forward, self.timeline, self.gather_dtype
            )
        return self._gather

    @contextlib.contextmanager
    def evaluating(self, params: Params, comm: Comm) -> Iterator[tuple[Params, Callable[[Callable], Callable], Comm]]:
        """Every rank evaluates, a share of the pieces each: each forward gathers the buckets as it reads
        them and releases them after (``ParamGather``, as training's forward does), so no rank holds the
        whole params, and every rank runs as many forwards. (A world at stage 3 never changes: ``comm`` is
        the one it was made with.)"""
        gather = self.gather
        gather.start(params)
        try:
            yield gather.views, gather.wrap_loss, comm
        finally:
            gather.stop()

    def for_step(
        self, comm: Comm, timeline: Timeline | None = None, donate: bool = False, early: bool = False
    ) -> "ParamShardedUpdate":
        return ParamShardedUpdate(
            self.optimizer,
            self.plan,
            comm,
            self.model,
            self.reshard_after_forward,
            timeline,
            donate,
            early,
            self.mirror,
            self.gather_dtype,
            self.groups,
        )

    def reduction_comm(self, comm: Comm) -> Any:
        # Hybrid: the chain reduces across the replicas inside reduction_hook; the runtime's comm counts its bytes.
        return ScatterComm(comm, self.plan) if self.groups is None else comm

    def first_state_made(
        self,
        make: Callable[[str], torch.Tensor],
        buffers: Buffers,
        hook: Hook | None,
        comm: Comm,
        seed: int = 0,
        precision: Any = None,
    ) -> TrainState:
        """``first_state`` from params made one at a time by ``make(name)`` (a build on ``meta``,
        ``fdp.model.deferred``): this rank keeps its slices alone and never holds the whole params
        (``fdp.update.zero.built``)."""
        return sliced_first_state(
            make,
            buffers,
            self.optimizer,
            self.plan,
            comm,
            self.reduction_hook(hook or allreduce()),
            seed,
            self.mirror,
            precision,
            self._shard_comm(comm),
        )

    def check_state(self, state: Any) -> None:
        if not (params_sharded(state.params, self.plan) and is_sharded(state.opt_state, self.plan)):
            raise ValueError(
                "zero_stage=3: state.params are not this rank's slices by bucket; build the state with "
                "fdp.update.zero.init_state(..., stage=3) or fdp.update.zero.shard_state(..., stage=3)"
            )
        check_same_replicas({}, state.buffers, self.comm, fresh=state.step == 0)  # the params are slices: each its own

    def begin(self, state: Any, grad_buffers: tuple[torch.Tensor, ...]) -> "_ParamShardedStep":
        self.gather.start(state.params)
        # An elementwise optimizer without an in-place form (a user's own) steps once every slice is in.
        per_bucket = (
            self.early
            and state.loss_scale is None
            and self.optimizer.elementwise
            and self.optimizer.update_inplace is not None
        )
        return _ParamShardedStep(self, state, per_bucket)


class _ParamShardedStep(SliceStep):
    def __init__(self, owner: ParamShardedUpdate, state: Any, per_bucket: bool):
        super().__init__(owner, sliced=True)
        self.state, self.per_bucket, self.mirror = state, per_bucket, state.mirror
        # Each slice stepped in place as its reduction ends, while backward runs: backward reads the gathered copies.
        self.steps_in_backward = per_bucket
        self.params = owner.gather.views
        self.grads: dict[str, torch.Tensor] = {}
        self.opt_state = state.opt_state

    def reduced(self, index: int, buffer: torch.Tensor) -> None:
        """Take this rank's slice of bucket ``index``'s reduced gradient; step it now where allowed."""
        owner = self.owner
        bucket = owner.plan.buckets[index]
        start, stop = slice_range(bucket, self.rank, self.world)
        if buffer.numel() == bucket.numel and buffer.numel() != stop - start:  # a chain that sent nothing
            buffer = padded_slice(buffer, start, stop)
        require(
            buffer.numel() == stop - start,
            f"zero_stage=3: bucket {index}'s reduced gradient",
            buffer.numel(),
            f"this rank's slice of {stop - start} elements",
        )
        self.take(index, buffer, buffer)
        key = slice_key(index)
        if self.per_bucket:  # donated: the slice is stepped in place
            with owner.timeline.span("optimizer", bucket=index):
                self.opt_state = owner.slice_optimizer.update_inplace(
                    {key: buffer}, self.state.opt_state, {key: self.state.params[key]}
                )
        else:
            self.grads[key] = buffer

    def finish(self) -> tuple[dict, Any]:
        """Step the slices not stepped yet; ``(params, opt_state)``, the params this rank's slices."""
        owner = self.owner
        if self.per_bucket:
            return self.state.params, self.opt_state
        with owner.timeline.span("optimizer"):
            return apply_gradients(
                owner.slice_optimizer,
                self.grads,
                self.state.opt_state,
                self.state.params,
                donate=owner.donate,
                sum_across=self._sum_across,
            )
