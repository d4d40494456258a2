"""The gradient reduction of one step: buckets through the hook chain, many in flight.

Two schedules share this module:

* ``after``: backward runs to the end, the gradients are packed into the bucket buffers,
  then every bucket's hook chain starts.
* ``overlap``: tensor hooks registered inside the ``torch.func`` transform copy each
  gradient into its bucket as backward produces it, and a bucket's chain starts the
  moment its last gradient lands, so communication runs while backward goes on.

Either way buckets start in plan order and are resumed in plan order, so every rank
issues the same collectives in the same sequence, whatever the timing.
"""
from __future__ import annotations

import inspect
import time
from typing import Any, Callable, NamedTuple

import torch
from torch.func import grad_and_value

from fdp import buckets as bucket_buffers
from fdp.comm import Comm
from fdp.hooks.base import GradBucket, Hook
from fdp.plan import BucketPlan
from fdp.trace import Timeline

SCHEDULES = ("after", "overlap")


class ReduceStats(NamedTuple):
    """What one step's reduction cost: seconds blocked on communication, bytes this rank sent."""

    wait_s: float
    bytes_sent: int
    collectives: int


class Reduced(NamedTuple):
    """A step's reduced gradients (views into ``flats``) and what came with them."""

    grads: dict[str, torch.Tensor]
    flats: tuple[torch.Tensor, ...]
    hook_states: tuple
    losses: list
    auxes: list
    stats: ReduceStats


class Reduction:
    """The hook chains of one step's buckets, started in plan order and finished together.

    ``on_reduced(index, grads)``, if given, sees each bucket's reduced gradient as soon as
    its chain is done, while later buckets are still in flight; it runs inside
    ``finish()``, never from inside backward (where the parameters are still in use).
    """

    def __init__(
        self, hook: Hook, comm: Comm, states: tuple, plan: BucketPlan, timeline: Timeline | None = None,
        on_reduced: Callable[[int, GradBucket], None] | None = None,
    ):
        self._hook, self._comm, self._states, self._plan = hook, comm, states, plan
        self._timeline = timeline
        self._on_reduced = on_reduced
        self._running: dict[int, Any] = {}  # bucket index -> (generator, pending)
        self._done: dict[int, tuple[GradBucket, Any]] = {}
        self._unreported: list[int] = []  # finished buckets not yet passed to on_reduced
        self._stage: dict[int, int] = {}  # bucket index -> collectives issued so far
        self.started = 0

    def start(self, flat: torch.Tensor) -> None:
        """Start the next bucket's chain (buckets start strictly in plan order)."""
        index = self.started
        self.started += 1
        if self._timeline:
            self._timeline.bucket_begin(index)
        # The bucket buffer is scratch the reducer refills every step: the chain may work in it.
        grads = GradBucket(index, flat, self._plan.buckets[index], owned=True)
        run = self._hook.apply(self._states[index], grads, self._comm)
        if not inspect.isgenerator(run):
            self._finished(index, run)
            return
        self._advance(index, run, None)

    def _finished(self, index: int, result) -> None:
        self._done[index] = result
        self._running.pop(index, None)
        self._unreported.append(index)
        if self._timeline:
            self._timeline.bucket_end(index)

    def _report(self) -> None:
        if self._on_reduced is not None:
            for index in self._unreported:
                self._on_reduced(index, self._done[index][0])
        self._unreported.clear()

    def _advance(self, index: int, run, value) -> None:
        try:
            pending = run.send(value)
        except StopIteration as finished:
            self._finished(index, finished.value)
            return
        self._running[index] = (run, pending)
        stage = self._stage[index] = self._stage.get(index, 0) + 1
        if self._timeline:
            self._timeline.collective_begin(index, stage)

    def finish(self) -> tuple[tuple[torch.Tensor, ...], tuple, float]:
        """Resume the chains round by round until all are done.

        Returns the reduced flat buffers and the new states in plan order, and the
        seconds spent blocked on collectives.
        """
        waited = 0.0
        self._report()
        while self._running:
            for index in sorted(self._running):
                run, pending = self._running[index]
                t0 = time.perf_counter()
                value = pending.wait()
                waited += time.perf_counter() - t0
                if self._timeline:
                    self._timeline.collective_end(index, self._stage[index])
                self._advance(index, run, value)
                self._report()
        if len(self._done) != len(self._plan.buckets):
            raise RuntimeError(f"{len(self._plan.buckets) - len(self._done)} buckets were never started")
        results = [self._done[i] for i in range(len(self._done))]
        flats = tuple(grads.buffer for grads, _ in results)
        states = tuple(state for _, state in results)
        return flats, states, waited


def init_hook_states(hook: Hook, plan: BucketPlan) -> tuple:
    """One hook state per bucket of ``plan``."""
    return tuple(hook.init(bucket) for bucket in plan.buckets)


def _marking_forward_end(loss_fn: LossFn, timeline: Timeline) -> LossFn:
    """``loss_fn`` that notes on ``timeline`` when the forward is done (backward starts next)."""

    def marked(*args):
        out = loss_fn(*args)
        timeline.forward_end_us = timeline.now_us()
        return out

    return marked


class _SlotTable(NamedTuple):
    bucket: dict[str, int]
    views: dict[str, torch.Tensor]  # flat slot views into the bucket buffers
    sizes: list[int]  # tensors per bucket


def _slot_table(plan: BucketPlan, flats: tuple[torch.Tensor, ...]) -> _SlotTable:
    bucket, views = {}, {}
    for b, flat in zip(plan.buckets, flats):
        for slot in b.slots:
            bucket[slot.name] = b.index
            views[slot.name] = flat[slot.offset : slot.offset + slot.numel]
    return _SlotTable(bucket, views, [len(b.slots) for b in plan.buckets])


LossFn = Callable[..., tuple[torch.Tensor, Any]]  # (params, buffers, batch) -> (loss, aux)


class GradReducer:
    """Computes a step's gradients and reduces them through ``hook`` over ``plan``.

    It owns the bucket buffers (allocated once, reused every step); the gradients it
    returns are views into them, valid until the next call.
    """

    def __init__(
        self, loss_fn: LossFn, plan: BucketPlan, hook: Hook, comm: Comm, schedule: str = "after",
        timeline: Timeline | None = None,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"trainer.schedule={schedule!r}: expected one of {SCHEDULES}")
        self.plan, self.hook, self.comm, self.schedule = plan, hook, comm, schedule
        self.timeline = timeline
        self.loss_fn = _marking_forward_end(loss_fn, timeline) if timeline else loss_fn
        loss_fn = self.loss_fn
        self.flats = bucket_buffers.allocate(plan)
        self._table = _slot_table(plan, self.flats)
        self._plain_grad = grad_and_value(loss_fn, has_aux=True)
        self._hooked_grad = grad_and_value(self._traced_loss, argnums=0, has_aux=True)
        self._reduction: Reduction | None = None
        self._remaining: list[int] = []
        self._scale = 1.0
        self._accumulate = False

    def __call__(
        self, params, buffers, micro_batches: list, hook_states: tuple,
        on_reduced: Callable[[int, GradBucket], None] | None = None,
    ) -> Reduced:
        """Gradients of the mean loss over ``micro_batches``, reduced over ranks.

        ``buffers`` flow through the micro-batches in order (the last ``aux`` carries
        the newest). ``on_reduced`` is passed on to the ``Reduction``.
        """
        self.comm.take_counters()
        reduction = Reduction(self.hook, self.comm, hook_states, self.plan, self.timeline, on_reduced)
        scale = 1.0 / len(micro_batches)
        losses, auxes = [], []
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            start_us = self.timeline.now_us() if self.timeline else 0.0
            if last and self.schedule == "overlap":
                loss, aux = self._overlapped(params, buffers, batch, reduction, scale, accumulate=i > 0)
            else:
                grads, (loss, aux) = self._plain_grad(params, buffers, batch)
                self._store(grads, scale, accumulate=i > 0)
            if self.timeline:
                forward_end = self.timeline.forward_end_us
                self.timeline.complete("forward", start_us, forward_end, micro_batch=i)
                self.timeline.complete("backward", forward_end, self.timeline.now_us(), micro_batch=i)
            buffers = aux[0] if isinstance(aux, tuple) else buffers
            losses.append(loss)
            auxes.append(aux)
        while reduction.started < len(self.plan.buckets):
            reduction.start(self.flats[reduction.started])
        flats, new_states, wait_s = reduction.finish()
        sent, count = self.comm.take_counters()
        grads = bucket_buffers.unpack(self.plan, flats)
        return Reduced(grads, flats, new_states, losses, auxes, ReduceStats(wait_s, sent, count))

    def _store(self, grads: dict, scale: float, accumulate: bool) -> None:
        names = [n for n in self._table.views if n in grads]
        views = [self._table.views[n] for n in names]
        values = [grads[n].reshape(-1) for n in names]
        if accumulate:
            torch._foreach_add_(views, values, alpha=scale)
        else:
            torch._foreach_copy_(views, values)
            if scale != 1.0:
                torch._foreach_mul_(views, scale)

    # -- overlap: the buckets fill and launch from inside backward ---------------------

    def _overlapped(self, params, buffers, batch, reduction: Reduction, scale: float, accumulate: bool):
        self._reduction, self._scale, self._accumulate = reduction, scale, accumulate
        self._remaining = list(self._table.sizes)
        self._handles = []
        try:
            _, (loss, aux) = self._hooked_grad(params, self.flats, buffers, batch)
        finally:
            # The hooks hold this reducer and the wrapped bucket buffers; drop them from the
            # (already dead) wrapped parameters so nothing of this step outlives it.
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._reduction = None
        self._check_all_ready()
        return loss, aux

    def _check_all_ready(self) -> None:
        # A bucket left incomplete would be reduced with last step's values: refuse.
        missing = [
            slot.name
            for b, left in zip(self.plan.buckets, self._remaining)
            if left and not b.unused
            for slot in b.slots
        ]
        if missing:
            raise RuntimeError(
                f"parameters got no gradient this step though the plan expects one: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; the bucket plan assumes the same parameters are used every step"
            )

    def _traced_loss(self, params, flats_arg, buffers, batch):
        # The buckets come in as an argument: a tensor hook inside the transform may write
        # into an argument of the transformed function but not into a captured tensor.
        for name, p in params.items():
            self._handles.append(p.register_hook(self._make_tensor_hook(name, flats_arg, tuple(p.shape))))
        return self.loss_fn(params, buffers, batch)

    def _make_tensor_hook(self, name: str, flats_arg, shape: tuple[int, ...]):
        bucket = self._table.bucket[name]
        view_of = self._table.views[name]
        start = view_of.storage_offset() - self.flats[bucket].storage_offset()
        stop = start + view_of.numel()

        def on_grad_ready(grad):
            # torch.func.grad differentiates with create_graph=True, so ``grad`` carries a
            # graph (it requires grad). Copied with autograd on, the bucket buffer would
            # record a CopySlices node whose graph saves this step's wrapped parameters;
            # the parameters' hooks hold this closure, which holds the buffer: a cycle
            # through C++ that Python's gc cannot break. Every step's parameters (one
            # gradient-sized set, ~100 MB on a 25M model) then stayed alive for good, and
            # the growth slowed the step down. The bucket is never differentiated, so the
            # copy runs without autograd.
            with torch.no_grad():
                target = flats_arg[bucket][start:stop].view(shape)
                if self._accumulate:
                    target.add_(grad, alpha=self._scale)
                elif self._scale != 1.0:
                    torch.mul(grad, self._scale, out=target)
                else:
                    target.copy_(grad)
            self._remaining[bucket] -= 1
            reduction = self._reduction
            # Hook chains run outside the transform: tensors they create (and keep in
            # their state) must be plain tensors, not this grad level's wrappers.
            with torch._C._DisableFuncTorch(), torch.no_grad():
                while reduction.started < len(self._remaining) and self._remaining[reduction.started] == 0:
                    reduction.start(self.flats[reduction.started])
            # Returning None keeps autograd's own gradient (returning it again also kept
            # a gradient set alive, through the same cycle).
            return None

        return on_grad_ready
