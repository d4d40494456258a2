"""From reduced gradients to new params: the one update interface of every ZeRO stage.

A train step (``fdp.step``) holds one ``Update`` for its whole life. Each step it asks
``begin(state, grad_buffers)`` for a ``StepUpdate``, runs forward and backward on that
value's ``params``, hands it every bucket the reduction finishes, in the order they
finish, reads its ``verdict()`` and, unless the step is skipped, ends with ``finish()``::

    update = step_update.begin(state, reducer.flats)
    ... backward over update.params ...
    for index, bucket in reduction.finished():
        update.reduced(index, bucket.buffer)
    ok = update.verdict()               # on the device: all True when every gradient was finite
    params, opt_state = update.finish()

What varies between the stages lives behind those calls: which comm the hook chain
reduces over (stages 2 and 3 reduce-scatter: ``reduction_comm``), which params the
forward sees (stage 3 gathers them bucket by bucket), what each rank steps
(the whole params, or its slice of every bucket) and what it all-gathers afterwards.
``ReplicatedUpdate`` here is stage 0; stages 1 to 3 live in ``fdp.zero``.

>>> from fdp import functionalize, init_train_state, sgd
>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([("w", (2,), "float32", "cpu")])
>>> state = init_train_state({"w": torch.ones(2)}, {}, sgd(0.5), plan)
>>> update = ReplicatedUpdate(sgd(0.5), plan).begin(state, ())
>>> update.reduced(0, torch.tensor([1.0, -1.0]))
>>> bool(update.verdict().all()), update.finish()[0]["w"].tolist()
(True, [0.5, 1.5])
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from fdp.buckets import slot_views
from fdp.checks import check_same_replicas, check_state_against_plan
from fdp.comm import Comm
from fdp.optim import GradientTransformation, apply_gradients, supports_inplace
from fdp.plan import BucketPlan
from fdp.trace import NullTimeline, Timeline

__all__ = ["Update", "StepUpdate", "ReplicatedUpdate", "bucket_norm", "finite_flag", "global_norm", "describe_bucket"]


class StepUpdate(Protocol):
    """One step's update, made by ``Update.begin``.

    ``params``: what forward and backward run on this step (at ZeRO stage 3, views that
    the update's ``gather`` fills bucket by bucket while they are read). ``wait_s``:
    seconds this step's update spent blocked on communication of its own (all-gathers, a
    norm's all-reduce). ``mirror``: the state's copy of the next rank's optimizer-state
    slices (``TrainState.mirror``, ZeRO stage 1 in a world that may shrink), stepped by
    ``finish()``; ``None`` where none is kept.
    """

    params: dict
    wait_s: float
    mirror: Any

    def reduced(self, index: int, buffer: torch.Tensor) -> None:
        """Take bucket ``index``'s reduced gradient (buckets arrive in the order they finish)."""

    def verdict(self) -> torch.Tensor:
        """On the device, the same on every rank: all True when every reduced gradient is finite."""

    def grad_norm(self) -> torch.Tensor:
        """On the device, the same on every rank: the global L2 norm of the reduced gradient, before any clipping
        (asked after ``verdict()``)."""

    def finish(self) -> tuple[dict, Any]:
        """``(params, opt_state)`` after the optimizer step (not called for a skipped step)."""

    def nonfinite_where(self, late: bool) -> str:
        """Where a non-finite gradient was seen, for the error (``late``: read a step later)."""


class Update(Protocol):
    """The update of every step of one train step function (see the module docstring).

    ``flat_params``: whether the params it steps may be laid out one flat buffer per
    bucket and so cross ``torch.func`` (``fdp.buckets.lay_out``); sharded params keep
    ZeRO's own layout. ``gather``: what materialises sharded params while forward and
    backward read them (ZeRO stage 3's ``ParamGather``, handed to the ``GradReducer``);
    ``None`` where the params are whole.
    """

    flat_params: bool
    gather: Any

    def reduction_comm(self, comm: Comm) -> Any:
        """The comm the hook chain reduces over."""

    def check_state(self, state: Any) -> None:
        """Refuse, in one line, a state this update cannot step, or one the ranks do not share (the first step)."""

    def begin(self, state: Any, grad_buffers: tuple[torch.Tensor, ...]) -> StepUpdate:
        """The update of one step from ``state``; ``grad_buffers`` are the reducer's bucket buffers."""


def bucket_norm(flat: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a bucket's (or slice's) gradient, in float32 whatever its dtype, kept on the device.

    >>> bucket_norm(torch.tensor([3.0, 4.0], dtype=torch.bfloat16)).item()
    5.0
    """
    return torch.linalg.vector_norm(flat, dtype=torch.float32)


def global_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The norm of the concatenated tensors whose norms are ``norms`` (on the first one's device).

    >>> global_norm([torch.tensor(3.0), torch.tensor(4.0)]).item()
    5.0
    """
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def finite_flag(flat: torch.Tensor) -> torch.Tensor:
    """One flag per bucket, kept on the device: a NaN or inf anywhere makes the sum non-finite.

    >>> finite_flag(torch.tensor([1.0, float("nan")])).item()
    False
    """
    return torch.isfinite(flat.sum(dtype=torch.float32))


def describe_bucket(plan: BucketPlan, index: int) -> str:
    """How an error names a bucket: its index and its first parameters.

    >>> from fdp.plan import pack_into_buckets
    >>> describe_bucket(pack_into_buckets([("w", (2,), "float32", "cpu")]), 0)
    'bucket 0 (w)'
    """
    names = plan.buckets[index].names
    return f"bucket {index} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


class ReplicatedUpdate:
    """ZeRO stage 0: every rank holds every parameter and steps it with the whole reduced gradient.

    ``early=True`` (a donated state whose step is never skipped) lets an elementwise
    optimizer that runs in place (``fdp.optim.supports_inplace``) step each bucket's params
    the moment its reduction is done, while later buckets are still on the wire; otherwise
    the optimizer steps once every bucket is in (global-norm clipping needs them all).
    """

    flat_params = True
    gather = None

    def __init__(self, optimizer: GradientTransformation, plan: BucketPlan, comm: Comm | None = None,
                 timeline: Timeline | None = None, donate: bool = False, early: bool = False):
        self.optimizer, self.plan, self.donate, self.early = optimizer, plan, donate, early
        self._views: list[dict] | None = None  # the grad buffers' views, made once
        self.comm = comm or Comm()
        self.timeline = timeline or NullTimeline()
        self._per_bucket: bool | None = None  # decided on the first step: params keep their device and dtype

    def reduction_comm(self, comm: Comm) -> Comm:
        return comm

    def check_state(self, state: Any) -> None:
        check_state_against_plan(state, self.plan)
        check_same_replicas(state.params, state.buffers, self.comm, fresh=state.step == 0)

    def begin(self, state: Any, grad_buffers: tuple[torch.Tensor, ...]) -> "_ReplicatedStep":
        if self._per_bucket is None:
            self._per_bucket = (self.early and state.loss_scale is None and self.optimizer.elementwise
                                and supports_inplace(self.optimizer, state.params))
        if self._views is None and grad_buffers:
            self._views = [slot_views(b, flat) for b, flat in zip(self.plan.buckets, grad_buffers)]
        return _ReplicatedStep(self, state, self._per_bucket, grad_buffers)


class _ReplicatedStep:
    def __init__(self, owner: ReplicatedUpdate, state: Any, per_bucket: bool, grad_buffers: tuple):
        self.owner, self.state, self.per_bucket, self.grad_buffers = owner, state, per_bucket, grad_buffers
        self.params, self.mirror = state.params, state.mirror
        self.grads: list[dict] = [{}] * len(owner.plan.buckets)
        self.flags: list[torch.Tensor | None] = [None] * len(owner.plan.buckets)  # by bucket index
        self.norms: list[torch.Tensor | None] = [None] * len(owner.plan.buckets)
        self.opt_state = state.opt_state
        self.wait_s = 0.0

    def reduced(self, index: int, buffer: torch.Tensor) -> None:
        owner = self.owner
        # A chain that reduces in place hands back the reducer's own buffer, whose views are made once.
        mine = bool(self.grad_buffers) and buffer is self.grad_buffers[index]
        self.grads[index] = dict(owner._views[index]) if mine else slot_views(owner.plan.buckets[index], buffer)
        self.flags[index] = finite_flag(buffer)
        self.norms[index] = bucket_norm(buffer)  # before an in-place optimizer may overwrite the gradient
        if self.per_bucket:  # every call of one step gets the same state and returns the same new one
            with owner.timeline.span("optimizer", bucket=index):
                self.opt_state = owner.optimizer.update_inplace(self.grads[index], self.state.opt_state, self.state.params)

    def verdict(self) -> torch.Tensor:
        return torch.stack(self.flags)

    def grad_norm(self) -> torch.Tensor:
        return global_norm(self.norms)

    def finish(self) -> tuple[dict, Any]:
        if self.per_bucket:
            return self.state.params, self.opt_state
        grads = {name: grad for bucket in self.grads for name, grad in bucket.items()}  # in plan order
        with self.owner.timeline.span("optimizer"):
            return apply_gradients(self.owner.optimizer, grads, self.state.opt_state, self.state.params,
                                   donate=self.owner.donate)

    def nonfinite_where(self, late: bool) -> str:
        if late:  # the bucket buffers hold the next step's gradients by now: name the bucket
            index = int((~self.verdict()).nonzero()[0])
            return describe_bucket(self.owner.plan, index)
        name = next(n for bucket in self.grads for n, g in bucket.items() if not torch.isfinite(g).all())
        return f"parameter {name!r}"
