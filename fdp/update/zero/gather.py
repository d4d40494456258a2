"""ZeRO stage 3's whole params, materialised bucket by bucket while forward and backward need them.

Between steps each rank holds only its slice of every bucket (``TrainState.params`` at
stage 3). A ``ParamGather`` keeps one padded flat buffer per bucket, whose memory is
released while the bucket is not needed, and the parameter tensors the forward sees are
views of those buffers, made once. Gathering a bucket gives its buffer memory back and
all-gathers every rank's slice into it; releasing it frees the memory again. The buffers
may be of a narrower dtype than the slices (bfloat16 under ``bf16-mixed``, as FSDP2's
``param_dtype``): each rank casts its slice into its part of the buffer, and the gather
sends the narrow values.

When, is learnt once, from one extra forward on the first step's first micro-batch (no
gradients, the random generators restored after it). A dispatch mode sees every
operation of that forward: a bucket is gathered the moment an operation reads it (at
most ``_RECORDING_BUCKETS`` at a time, the least recently read released first), and the
mode notes between which hook events (the ``pre`` and ``post`` hooks of the modules that
hold parameters, and of the root module) each bucket is first and last read. From then
on each bucket is gathered in the hook before its first read, the next one's all-gather
is issued at the same time (to be ready when it is needed), and, with
``reshard_after_forward``, it is released in the hook after its last read. Gradient
hooks on the outputs of the modules that hold a released bucket gather it again before
backward reaches them, and once all its gradients are in (``grads_done``), it is
released for good. At no point are all params whole at once.

Two safeguards keep the views from being read while released. A bucket that the
recording forward read outside the forward of every module holding it (a parent module
that reads a child's weight) is kept from its first read to its last gradient. A forward
whose hook events leave the recorded sequence gathers every bucket at that point and
releases nothing more until the step ends. This is FSDP's contract (params are read in
the forward of the module that holds them), made safe where a model strays from it; a
model whose forward reads other buckets between the same hooks from one step to the
next (data-dependent control flow across modules) is outside it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fdp._torch import TorchDispatchMode, disable_functorch, storage_id, tree_flatten
from fdp.comm import Comm, Pending
from fdp.model.functional import FunctionalModel
from fdp.model.recompute import recomputing
from fdp.model.streams import rehearsal
from fdp.plan import BucketPlan
from fdp.plan.buckets import allocate_released, regrow, release, slot_views
from fdp.trace import NullTimeline, Timeline
from fdp.update.zero.layout import slice_key, slice_numel, slice_range

__all__ = ["ParamGather"]

_START = -1  # "at the start of the forward": before its first hook event
_RECORDING_BUCKETS = 2  # buckets whole at once during the recording forward


class _Recorder(TorchDispatchMode):
    """The recording forward: each bucket an operation reads is gathered first, and the read noted."""

    def __init__(self, gather: "ParamGather"):
        super().__init__()
        self.gather = gather

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        gather = self.gather
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                bucket = gather._bucket_of.get(storage_id(t))
                if bucket is not None:
                    gather._read(bucket)
        return func(*args, **(kwargs or {}))


class _Schedule:
    """Where each bucket is gathered and released, by hook event (learnt from the recording forward)."""

    def __init__(self, events: list, first: dict[int, int], last: dict[int, int], pinned: set[int]):
        self.events = events
        self.gather_at: dict[int, list[int]] = {}
        self.release_at: dict[int, list[int]] = {}
        for bucket, read in first.items():
            self.gather_at.setdefault(read - 1 if read else _START, []).append(bucket)
        for bucket, read in last.items():
            if bucket not in pinned and read < len(events):
                self.release_at.setdefault(read, []).append(bucket)
        self.order = sorted(first, key=first.get)  # the order the forward first reads the buckets in
        self.next = {bucket: following for bucket, following in zip(self.order, self.order[1:])}


class ParamGather:
    """Whole params of ZeRO stage 3, gathered bucket by bucket (see the module docstring).

    Each step: ``start(shards)``; forward and backward on ``views`` with the loss wrapped
    by ``wrap_loss``; ``grads_done(i)`` as each bucket's gradients are complete
    (``again()`` before each further micro-batch); ``stop()``.
    """

    gathers = True  # what tells it from the reducer's ``NullGather``

    def __init__(
        self,
        model: FunctionalModel,
        plan: BucketPlan,
        comm: Comm,
        reshard_after_forward: bool = True,
        timeline: Timeline | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.plan, self.comm, self.reshard = plan, comm, reshard_after_forward
        self.timeline = timeline or NullTimeline()
        self.rank, self.world = comm.rank, comm.world_size
        # Each bucket's buffer released as soon as its views are made: all of them whole may not fit the rank.
        self.flats, views = allocate_released(
            plan,
            lambda bucket, flat: slot_views(bucket, flat[: bucket.numel], flat.dtype),  # narrower under bf16 gathers
            numel=lambda bucket: slice_numel(bucket, self.world) * self.world,
            dtype=dtype,
        )
        by_name = {name: view for part in views for name, view in part.items()}
        self.views = {name: by_name[name] for name in plan.names}
        self._bucket_of = {storage_id(flat): index for index, flat in enumerate(self.flats)}
        self.model = model
        self._holders = self._holders_of(model)
        self._handles = self._hook_holders()
        self._schedule: _Schedule | None = None
        self._pinned: set[int] = set()
        self._pending: dict[int, Pending] = {}
        self._gathered: dict[int, None] = {}  # in the order they were last read (the recording forward's LRU)
        self._shards: dict[str, torch.Tensor] = {}
        self._active = False
        self._new_forward()
        self._done: set[int] = set()

    def _holders_of(self, model: FunctionalModel, units: tuple[nn.Module, ...] = ()) -> dict[int, tuple[int, ...]]:
        """The buckets whose params each module holds, by module id: a unit's are those of every param inside
        it, and the modules inside a unit hold none; any other module's, those it holds itself (through ties too).
        """
        where = {name: b.index for b in self.plan.buckets for name in b.names}
        kept_as = dict(model.ties)
        unit_ids = {id(u) for u in units}
        inside: set[int] = set()
        holders: dict[int, tuple[int, ...]] = {}
        for prefix, module in model.module.named_modules():
            if id(module) in inside:
                continue
            whole = id(module) in unit_ids
            if whole:
                inside.update(id(m) for m in module.modules())
            names = [
                f"{prefix}.{n}" if prefix else n
                for n, _ in module.named_parameters(recurse=whole, remove_duplicate=False)
            ]
            buckets = sorted({where[kept_as.get(n, n)] for n in names if kept_as.get(n, n) in where})
            if buckets:
                holders[id(module)] = tuple(buckets)
        return holders

    def _hook_holders(self) -> list:
        root = self.model.module
        return [
            h
            for m in root.modules()
            if id(m) in self._holders or m is root
            for h in (m.register_forward_pre_hook(self._pre_hook), m.register_forward_hook(self._post_hook))
        ]

    def hold_by(self, units: list[nn.Module]) -> None:
        """Gather and release at the forward hooks of ``units`` alone, each holding every bucket its params are in.

        Between those hooks nothing of the gather runs, so each unit's forward (a
        transformer block) can be one compiled region, its collectives outside it, as
        FSDP2 shards and compiles each block (``fdp.step.compiled.compiled_regions``).
        Called before the first step (the schedule is learnt at the units' hooks).
        """
        if self._schedule is not None:
            raise RuntimeError("ParamGather.hold_by: called after the first step learnt where to gather")
        for handle in self._handles:
            handle.remove()
        self._holders = self._holders_of(self.model, tuple(units))
        self._handles = self._hook_holders()

    def _new_forward(self) -> None:
        self._events: list[tuple[int, str]] = []
        self._stack: list[int] = []
        self._on_schedule = True

    # -- one step -------------------------------------------------------------------------
    def start(self, shards: dict[str, torch.Tensor]) -> None:
        """Begin a step whose slices are ``shards``."""
        self.stop()
        self._shards, self._active, self._done = shards, True, set()

    def stop(self) -> None:
        """End the step: every bucket released (what is still on the wire is finished first)."""
        for index in list(self._pending):
            self._pending.pop(index).wait()
        for index in range(len(self.flats)):
            self._release(index, force=True)
        self._active, self._shards = False, {}

    def abandon(self) -> None:
        """Leave the model for good, what is on the wire not waited for: a world that lost a rank mid-step goes on
        with another gather (its group may be gone), and a step that failed for good (``fdp.run.memory.micro_batch``) is
        redone by another step function; every bucket is released, and this one's hooks would gather again in its
        forwards."""
        for index in range(len(self.flats)):
            self._release(index, force=True)
        for handle in self._handles:
            handle.remove()
        self._handles, self._pending, self._active, self._shards = [], {}, False, {}

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` run with its params gathered as the schedule says (learnt on its first call)."""

        def forward(*args, **kwargs):
            if self._schedule is None:
                self._record(loss_fn, args, kwargs)
            self._new_forward()
            self._at_event(_START)
            return loss_fn(*args, **kwargs)

        return forward

    def _record(self, loss_fn: Callable, args: tuple, kwargs: dict) -> None:
        first, last = {}, {}
        self._first, self._last = first, last
        self._new_forward()
        devices = [torch.device(f.device) for f in self.flats if torch.device(f.device).type == "cuda"][:1]
        # Beside the step's forward: the samples' streams (fdp.model.streams) are drawn, not taken; compiled
        # regions run eager here, since the recording mode must see their ops one by one.
        with torch.no_grad(), torch.random.fork_rng(devices=devices), rehearsal():
            with torch.compiler.set_stance("force_eager"), _Recorder(self):
                loss_fn(*args, **kwargs)
        for index in range(len(self.flats)):
            self._release(index, force=True)
        self._schedule = _Schedule(list(self._events), first, last, self._pinned)

    def grads_done(self, index: int) -> None:
        """Every gradient of bucket ``index`` is in: its params are not needed again this step."""
        self._done.add(index)
        self._release(index)

    def again(self) -> None:
        """Another micro-batch of the step: the buckets whose gradients were all in are read again."""
        self._done = set()

    # -- hook events ----------------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if self._active and recomputing():  # a checkpointed module's forward again, in backward (fdp.model.recompute)
            for bucket in self._holders.get(id(module), ()):
                self.ensure(bucket)
        elif self._active:
            self._stack.append(id(module))
            self._event(module, "pre")

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._active or recomputing():
            return
        self._stack.pop()
        self._event(module, "post")
        buckets = self._holders.get(id(module), ())
        if buckets and self.reshard and self._schedule is not None:
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, buckets=buckets: self._before_backward(buckets))

    def _event(self, module: nn.Module, kind: str) -> None:
        index = len(self._events)
        self._events.append((id(module), kind))
        schedule = self._schedule
        if schedule is None:
            return
        if self._on_schedule and (index >= len(schedule.events) or schedule.events[index] != (id(module), kind)):
            self._on_schedule = False  # a forward unlike the recorded one: gather everything, release nothing more
            for bucket in range(len(self.flats)):
                if bucket not in self._done:
                    self.ensure(bucket)
        if self._on_schedule:
            self._at_event(index)

    def _at_event(self, index: int) -> None:
        schedule = self._schedule
        for bucket in schedule.gather_at.get(index, ()):
            self.ensure(bucket)
            if bucket in schedule.next:
                self._issue(schedule.next[bucket])
        if self.reshard:
            for bucket in schedule.release_at.get(index, ()):
                self._release(bucket)

    def _read(self, bucket: int) -> None:
        """The recording forward reads ``bucket``: gather it, and note where and by which module."""
        self.ensure(bucket)
        self._gathered.pop(bucket)
        self._gathered[bucket] = None  # the most recently read
        for old in list(self._gathered)[:-_RECORDING_BUCKETS]:
            self._release(old, force=True)
        event = len(self._events)
        self._first.setdefault(bucket, event)
        self._last[bucket] = event
        if not any(bucket in self._holders.get(module, ()) for module in self._stack):
            self._pinned.add(bucket)

    def _before_backward(self, buckets: tuple[int, ...]) -> None:
        for bucket in buckets:
            if bucket not in self._done:
                self.ensure(bucket)
        following = max(buckets) + 1  # backward reaches the buckets in plan order
        if following < len(self.flats) and following not in self._done:
            self._issue(following)

    # -- gathering -----------------------------------------------------------------------
    def _issue(self, index: int) -> None:
        if index in self._gathered or index in self._pending:
            return
        flat, bucket = self.flats[index], self.plan.buckets[index]
        start, stop = slice_range(bucket, self.rank, self.world)
        # Hooks run inside the torch.func transform: the buffers are written as plain tensors.
        with disable_functorch(), torch.no_grad():
            regrow(flat)
            flat[start:stop].copy_(self._shards[slice_key(index)])  # cast to the gather's dtype here, before the wire
            self.timeline.gather_begin(index)
            self._pending[index] = self.comm.all_gather_into(flat, flat[start:stop])

    def ensure(self, index: int) -> None:
        """Bucket ``index``'s params gathered: issued now if they are not on the wire yet, and waited for."""
        if index in self._gathered:
            return
        self._issue(index)
        with disable_functorch():
            self._pending.pop(index).wait()
        self.timeline.gather_end(index)
        self._gathered[index] = None

    def _release(self, index: int, force: bool = False) -> None:
        if index in self._gathered and (force or index not in self._pinned or index in self._done):
            release(self.flats[index])
            del self._gathered[index]
