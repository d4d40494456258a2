"""From reduced gradients to new params: the one update interface of every ZeRO stage.

A train step (``fdp.step.train_step``) holds one ``Update`` for its whole life. Each step it asks
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
``ReplicatedUpdate`` here is stage 0; stages 1 to 3 live in ``fdp.update.zero``.

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

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator, NamedTuple, Protocol

import torch

from fdp.comm import Comm
from fdp.hooks import Hook
from fdp.model.functional import Buffers, Params
from fdp.optim import GradientTransformation, apply_gradients, supports_inplace, takes_sum_across
from fdp.plan import BucketPlan
from fdp.plan.buckets import slot_views
from fdp.state.checks import check_same_replicas, check_state_against_plan
from fdp.state.replicas import setup_state
from fdp.state.train_state import TrainState
from fdp.trace import NullTimeline, Timeline
from fdp.update.bucket_stats import bucket_norm, describe_bucket, finite_flag, global_norm
from fdp.update.pieces import SliceRange, state_pieces
from fdp.update.replica import Replica

__all__ = [
    "STAGES",
    "Stage",
    "NullGather",
    "Update",
    "StepUpdate",
    "ReplicatedUpdate",
]


class Stage(NamedTuple):
    """What a ZeRO stage shards, and so what it accepts: each rule stated once, here.

    ``shards_optimizer``: each rank keeps the optimizer state of its slices alone;
    ``scatters``: the reduction hands each rank only its slice of a bucket, and the
    bucket buffers are released between steps; ``shards_params``: between steps a rank
    holds only its slices of the params, gathered in module hooks while they are read.
    Each ``refuses_*`` gives the reason a stage cannot take something (a phrase the
    caller puts after the setting it names), or ``None``.

    >>> STAGES[1].refuses_mirror() is None
    True
    >>> STAGES[2].refuses_mirror()
    "ZeRO stage 2 keeps no copy of the next rank's slices (a mirror: +33% state per rank, +17-50% bytes per step)"
    """

    number: int
    shards_optimizer: bool
    scatters: bool
    shards_params: bool

    def refuses_optimizer(self, optimizer: GradientTransformation) -> str | None:
        """Why this stage cannot step with ``optimizer``: a shard of the gradients needs cross-rank sums, and a rule
        on names needs the form that steps slices (``fdp.update.zero.decay``)."""
        if not self.shards_optimizer:
            return None
        if optimizer.by_name and optimizer.with_decay_mask is None:  # a weight-decay mask by name, of its own
            return (
                "the optimizer exempts params from weight decay by name, and has no with_decay_mask to step "
                "ZeRO's flat slices by their runs of decayed elements; expected zero_stage=0, an optimizer with "
                "with_decay_mask (sgd, adam, adamw) or optim.decay_filter=all"
            )
        if takes_sum_across(optimizer):
            return None
        return f"ZeRO stage {self.number} steps a shard of the gradients, which needs an update that takes sum_across="

    def refuses_mirror(self) -> str | None:
        """Why this stage keeps no copy of the next rank's slices (``TrainState.mirror``), and so cannot lose a rank
        in a flat world (a hierarchical one keeps a replica of every slice in each other node instead).

        Stage 1 steps the mirror from the whole reduced gradient it holds. Stages 2 and 3 hold only their slice
        of it: a mirror would need the next rank's slice too and would hold its state, counted on 4 ranks of a
        0.4M-param transformer under Adam (``benchmarks/results/zero_mirror.md``): +33% state per rank at stage 2,
        +100% at stage 3 (the next rank's param slices too: stage 3's memory saving halved), +50% bytes per step
        for one more reduce-scatter leg (+17% with each owner sending its reduced slice on; +25% at stage 3), and
        the optimizer's work twice (+2.2% per step, ``results/shrink_overhead.md``), every step, to save a restart
        from the last checkpoint when a rank is lost (a shrink loses 3.4x less time than a restart, the
        fault-tolerance guide). The stages that shard for memory are refused the copy that would spend it."""
        if not self.scatters:  # stage 0 holds everything; stage 1 steps the mirror from its whole reduced gradient
            return None
        more = "+100%" if self.shards_params else "+33%"
        return (
            f"ZeRO stage {self.number} keeps no copy of the next rank's slices (a mirror: {more} state per rank, "
            "+17-50% bytes per step)"
        )


STAGES = (
    Stage(0, False, False, False),
    Stage(1, True, False, False),
    Stage(2, True, True, False),
    Stage(3, True, True, True),
)


class NullGather:
    """Params that are whole already: nothing to gather (what ``fdp.trace.NullTimeline`` is to a timeline).

    The reducer's other gather is ZeRO stage 3's ``fdp.update.zero.gather.ParamGather``, which
    materialises each bucket's params while forward and backward read them. ``gathers``
    says whether the params are released bucket by bucket as their gradients complete
    (their gradients then start as soon as they are in, and their buffers are released).

    >>> gather = NullGather()
    >>> gather.wrap_loss(len) is len, gather.gathers
    (True, False)
    """

    gathers = False

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        return loss_fn

    def grads_done(self, index: int) -> None:
        pass

    def stop(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class StepUpdate(Protocol):
    """One step's update, made by ``Update.begin``.

    ``params``: what forward and backward run on this step (at ZeRO stage 3, views that
    the update's ``gather`` fills bucket by bucket while they are read). ``wait_s``:
    seconds this step's update spent blocked on communication of its own (all-gathers, a
    norm's all-reduce). ``mirror``: the state's copy of the next rank's optimizer-state
    slices (``TrainState.mirror``, ZeRO stage 1 in a world that may shrink), stepped by
    ``finish()``; ``None`` where none is kept. ``steps_in_backward`` (true):
    ``reduced`` may be called while backward still runs, as each bucket's reduction ends
    (ZeRO stage 3 stepping each slice in place: backward reads the gathered copies, never
    the slices), so the reduced gradients are freed one by one, not held to the end.
    """

    params: dict
    wait_s: float
    mirror: Any
    steps_in_backward: bool

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


def _as_is(forward: Callable) -> Callable:
    return forward


class Update(ABC):
    """The update of one ZeRO stage: every step of a train step function, and its state's whole life.

    Made once from the stage (``fdp.update.zero.update_for``); the train step, the trainer and
    the build ask it, never the stage's number:

    * each step: ``reduction_comm`` (what the hook chain reduces over), ``gather`` (what
      materialises sharded params while forward and backward read them, handed to the
      ``GradReducer``; a ``NullGather`` where the params are whole), ``release_buffers``
      (the reducer releases each bucket buffer once its chain is done), ``flat_params``
      (whether the params it steps may be laid out one flat buffer per bucket and so
      cross ``torch.func``, ``fdp.plan.buckets.lay_out``; sharded params keep ZeRO's own
      layout), ``check_state`` (the first step's) and ``begin``;
    * the state: ``first_state`` (the same on every rank, checked), ``to_checkpoint``,
      ``checkpoint_template`` and ``from_checkpoint`` (a whole-file checkpoint holds the whole state,
      which any stage and world size resumes), ``checkpoint_pieces`` (what this rank writes to, or
      reads from, a sharded one, by ``slice_range``), ``reshard`` after ranks were lost, ``evaluating``
      (what an evaluation runs on);
    * what it accepts: ``refuses_optimizer`` (every hook chain: one that makes the whole
      reduced bucket keeps the slice of it a scattering comm keeps, ``fdp.hooks.for_slices``)
      (``rules``: the stage's ``Stage``).

    ``for_step(comm, timeline, donate, early)`` is the same update for one train step
    function: the comm of its world, where it records spans, whether it may update a
    donated state in place, and whether an elementwise optimizer may step each bucket
    as soon as its reduction is done.
    """

    stage: int = 0
    flat_params = True
    gather: Any = NullGather()
    optimizer: GradientTransformation
    plan: BucketPlan
    comm: Comm

    @property
    def rules(self) -> Stage:
        return STAGES[self.stage]

    @property
    def release_buffers(self) -> bool:
        return self.rules.scatters

    def refuses_optimizer(self, optimizer: GradientTransformation) -> str | None:
        return self.rules.refuses_optimizer(optimizer)

    @contextlib.contextmanager
    def evaluating(
        self, params: Params, comm: Comm
    ) -> Iterator[tuple[Params, Callable[[Callable], Callable], Comm | None] | None]:
        """What an evaluation of the state's ``params`` runs on in the world of ``comm``: ``(params, wrap,
        together)``, each forward run as ``wrap(forward)``, ``together`` the ranks that share the pieces
        (``fdp.run.evaluate``), or ``None`` on a rank that does not evaluate. Params that are whole: rank 0
        evaluates them as they are, alone.

        >>> from fdp import sgd
        >>> from fdp.plan import pack_into_buckets
        >>> from fdp.update.zero import update_for
        >>> update = update_for(0, sgd(0.1), pack_into_buckets([("w", (2,), "float32", "cpu")]), Comm())
        >>> with update.evaluating({"w": torch.ones(2)}, Comm()) as (params, wrap, together):
        ...     params["w"].tolist(), wrap(len) is len, together
        ([1.0, 1.0], True, None)
        """
        yield (params, _as_is, None) if comm.rank == 0 else None

    @abstractmethod
    def for_step(
        self, comm: Comm, timeline: Timeline | None = None, donate: bool = False, early: bool = False
    ) -> "Update": ...

    def reduction_comm(self, comm: Comm) -> Any:
        """The comm the hook chain reduces over."""
        return comm

    def reduction_hook(self, hook: Hook) -> Hook:
        """The hook the reducer runs for ``hook`` (hybrid sharding runs it across the groups on each rank's slice:
        ``fdp.update.zero.hybrid``); the state's hook states are this hook's."""
        return hook

    @abstractmethod
    def check_state(self, state: Any) -> None:
        """Refuse, in one line, a state this update cannot step, or one the ranks do not share (the first step)."""
        ...

    @abstractmethod
    def begin(self, state: Any, grad_buffers: tuple[torch.Tensor, ...]) -> StepUpdate:
        """The update of one step from ``state``; ``grad_buffers`` are the reducer's bucket buffers."""
        ...

    @abstractmethod
    def first_state(
        self, params: Params, buffers: Buffers, hook: Hook | None, comm: Comm, seed: int = 0, precision: Any = None
    ) -> TrainState:
        """The state before step 1, the same on every rank of ``comm``: their plans, seeds and buffers
        compared, rank 0's params and buffers taken (``fdp.state.replicas.agreed_start``)."""
        ...

    def to_checkpoint(self, state: TrainState, comm: Comm) -> TrainState:
        """What a checkpoint of ``state`` holds: the whole state, on the rank that writes it (a collective)."""
        return state

    def checkpoint_template(self, state: TrainState) -> TrainState:
        """A state of the structure ``to_checkpoint`` gives, to restore a checkpoint into (nothing large allocated)."""
        return state

    def from_checkpoint(self, whole: TrainState, comm: Comm) -> TrainState:
        """This rank's state from a checkpoint's whole one (made at any stage and world size)."""
        return whole

    def slice_range(self, comm: Comm) -> SliceRange | None:
        """This rank's ``(start, stop)`` in each bucket's padded flat layout where the state holds slices; or
        ``None`` (the state holds whole tensors)."""
        return None

    def checkpoint_pieces(self, tree: dict, comm: Comm, reading: bool = False) -> tuple[dict, dict]:
        """The pieces of logical tensors in ``tree`` (parts of a state of this stage) that this rank writes to a
        sharded checkpoint, or (``reading``) reads into, filling ``tree`` in place (``fdp.update.pieces``)."""
        return state_pieces(tree, self.plan, comm.rank, comm.world_size, self.slice_range(comm), reading)

    def replica(self) -> Replica:
        """One replica of an outer loop under this update (``fdp.update.replica``): here every rank is one."""
        return Replica(self, self.plan)

    def reshard(
        self, state: TrainState, old_members: tuple[int, ...], new_members: tuple[int, ...], comm: Comm
    ) -> TrainState:
        """``state``, made for the world ``old_members``, for the ranks of ``new_members`` (whose world is ``comm``)
        after ranks were lost, or joined (``fdp.procs.grow``: a joiner holds the survivors' state); a collective."""
        return state


class ReplicatedUpdate(Update):
    """ZeRO stage 0: every rank holds every parameter and steps it with the whole reduced gradient.

    ``early=True`` (a donated state whose step is never skipped) lets an elementwise
    optimizer that runs in place (``fdp.optim.supports_inplace``) step each bucket's params
    the moment its reduction is done, while later buckets are still on the wire; otherwise
    the optimizer steps once every bucket is in (global-norm clipping needs them all).
    """

    def __init__(
        self,
        optimizer: GradientTransformation,
        plan: BucketPlan,
        comm: Comm | None = None,
        timeline: Timeline | None = None,
        donate: bool = False,
        early: bool = False,
    ):
        self.optimizer, self.plan, self.donate, self.early = optimizer, plan, donate, early
        self._views: list[dict] | None = None  # the grad buffers' views, made once
        self.comm = comm or Comm()
        self.timeline = timeline or NullTimeline()
        self._per_bucket: bool | None = None  # decided on the first step: params keep their device and dtype

    def for_step(
        self, comm: Comm, timeline: Timeline | None = None, donate: bool = False, early: bool = False
    ) -> "ReplicatedUpdate":
        return ReplicatedUpdate(self.optimizer, self.plan, comm, timeline, donate, early)

    def check_state(self, state: Any) -> None:
        check_state_against_plan(state, self.plan)
        check_same_replicas(state.params, state.buffers, self.comm, fresh=state.step == 0)

    def first_state(
        self, params: Params, buffers: Buffers, hook: Hook | None, comm: Comm, seed: int = 0, precision: Any = None
    ) -> TrainState:
        return setup_state(params, buffers, self.optimizer, self.plan, hook, comm, seed=seed, precision=precision)

    def begin(self, state: Any, grad_buffers: tuple[torch.Tensor, ...]) -> "_ReplicatedStep":
        if self._per_bucket is None:
            self._per_bucket = (
                self.early
                and state.loss_scale is None
                and self.optimizer.elementwise
                and supports_inplace(self.optimizer, state.params)
            )
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
        self.steps_in_backward = False  # its buckets' gradients are stepped together in finish()

    def reduced(self, index: int, buffer: torch.Tensor) -> None:
        owner = self.owner
        # A chain that reduces in place hands back the reducer's own buffer, whose views are made once.
        mine = bool(self.grad_buffers) and buffer is self.grad_buffers[index]
        self.grads[index] = dict(owner._views[index]) if mine else slot_views(owner.plan.buckets[index], buffer)
        self.flags[index] = finite_flag(buffer)
        self.norms[index] = bucket_norm(buffer)  # before an in-place optimizer may overwrite the gradient
        if self.per_bucket:  # every call of one step gets the same state and returns the same new one
            with owner.timeline.span("optimizer", bucket=index):
                self.opt_state = owner.optimizer.update_inplace(
                    self.grads[index], self.state.opt_state, self.state.params
                )

    def verdict(self) -> torch.Tensor:
        return torch.stack(self.flags)

    def grad_norm(self) -> torch.Tensor:
        return global_norm(self.norms)

    def finish(self) -> tuple[dict, Any]:
        if self.per_bucket:
            return self.state.params, self.opt_state
        grads = {name: grad for bucket in self.grads for name, grad in bucket.items()}  # in plan order
        with self.owner.timeline.span("optimizer"):
            return apply_gradients(
                self.owner.optimizer, grads, self.state.opt_state, self.state.params, donate=self.owner.donate
            )

    def nonfinite_where(self, late: bool) -> str:
        if late:  # the bucket buffers hold the next step's gradients by now: name the bucket
            index = int((~self.verdict()).nonzero()[0])
            return describe_bucket(self.owner.plan, index)
        name = next(n for bucket in self.grads for n, g in bucket.items() if not torch.isfinite(g).all())
        return f"parameter {name!r}"
