"""The gradient reduction of one step: buckets through the hook chain, many in flight.

Two schedules share this module:

* ``after``: backward runs to the end, the gradients are packed into the bucket buffers,
  then every bucket's hook chain starts.
* ``overlap``: tensor hooks registered inside the ``torch.func`` transform copy each
  gradient (or, for params laid out flat, each bucket's) into its bucket as backward
  produces it, and a bucket's chain starts the moment its last gradient lands, so
  communication runs while backward goes on.

Either way buckets start in plan order and are resumed in plan order (``fdp.step.chains``),
so every rank issues the same collectives in the same sequence, whatever the timing.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple

import torch
from torch.func import grad_and_value as func_grad_and_value

from fdp._torch import HAS_DISABLE_FUNCTORCH, disable_functorch, foreach
from fdp.comm import Comm
from fdp.errors import check_choice
from fdp.hooks.base import GradBucket, Hook
from fdp.model.functional import autograd_grad_and_value, grad_and_value
from fdp.plan import Bucket, BucketPlan
from fdp.plan import buckets as bucket_buffers
from fdp.step.chains import Reduction
from fdp.step.compiled import compile_grad, compiled_regions, compiled_schedule, region_modules
from fdp.trace import NullTimeline, Timeline
from fdp.update.base import NullGather

SCHEDULES = ("auto", "after", "overlap")


def resolve_schedule(schedule: str, world_size: int) -> str:
    """When reductions start: ``after`` backward or ``overlap`` with it; ``auto`` picks by world size.

    ``auto`` is ``overlap`` on any world of more than one process. Starting each bucket's
    reduction inside backward hides communication wherever waiting on it leaves hardware
    idle: the GPU under NCCL, the CPU behind a network link (at 1 Gbit/s between two
    nodes, 6% faster than ``after``, ``bucket_size.md``). Even gloo on one 2-core host,
    where moving data takes the same cores as computing, measured it 2-5% faster than
    ``after`` (``vs_ddp.md``). A world of one has nothing to overlap, so it reduces
    ``after`` backward and skips the hooks.

    >>> resolve_schedule("auto", 1), resolve_schedule("auto", 2), resolve_schedule("after", 2)
    ('after', 'overlap', 'after')
    """
    check_choice("schedule", schedule, SCHEDULES)
    if schedule == "overlap" and not HAS_DISABLE_FUNCTORCH:
        raise ValueError("schedule='overlap': this torch cannot leave torch.func from a hook; expected after")
    if schedule == "auto":
        return "overlap" if world_size > 1 and HAS_DISABLE_FUNCTORCH else "after"
    return schedule


def reduces_each_micro_batch(hook_states: tuple) -> bool:
    """Whether ZeRO stage 3 reduces a step's micro-batches one by one: a chain whose buckets keep no state.

    At stage 3 each micro-batch's buckets are reduce-scattered as they fill and the slices
    summed (as FSDP2 does), so that a rank holds its slices and the buckets in flight, never
    the whole gradients: the step sends ``accum_steps`` times the bytes. A chain with no
    state is taken to reduce a sum of micro-batches as the sum of their reductions (a mean,
    a cast to ``trainer.reduce_dtype``, a compression round trip: up to rounding). A chain
    that keeps state per bucket (PowerSGD's error feedback and warm-up count, top-k's and
    low-bit's residuals) is meant to see one reduction per step: its buckets accumulate
    whole over the micro-batches and are reduced once, as at the other stages. Loss
    scaling and the finiteness verdict read the summed slices, as they read the reduced
    bucket.

    >>> reduces_each_micro_batch(((), ((), ()))), reduces_each_micro_batch(((), (torch.zeros(2),)))
    (True, False)
    """
    return all(isinstance(state, tuple) and reduces_each_micro_batch(state) for state in hook_states)


class _SlotTable(NamedTuple):
    bucket: dict[str, int]
    views: dict[str, torch.Tensor]  # flat slot views into the bucket buffers
    sizes: list[int]  # tensors per bucket


def _slot_views(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {slot.name: flat[slot.offset : slot.offset + slot.numel] for slot in bucket.slots}


def _slot_table(plan: BucketPlan, views: list[dict[str, torch.Tensor]]) -> _SlotTable:
    bucket = {name: b.index for b, part in zip(plan.buckets, views) for name in part}
    flat_views = {name: view for part in views for name, view in part.items()}
    return _SlotTable(bucket, flat_views, [len(b.slots) for b in plan.buckets])


LossFn = Callable[..., tuple[torch.Tensor, Any]]  # (params, buffers, batch) -> (loss, aux)


class Backward(NamedTuple):
    """What backward over one step's micro-batches leaves: every bucket's chain started."""

    reduction: Reduction
    losses: list  # one loss per micro-batch
    buffers: Any  # the model's buffers after the last micro-batch


class GradReducer:
    """Computes a step's gradients into the bucket buffers and starts their reduction.

    It owns the bucket buffers (allocated once, reused every step); the reduced buckets a
    ``Reduction`` hands back are these buffers (or what the chain made of them), valid
    until the next call.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        plan: BucketPlan,
        hook: Hook,
        comm: Comm,
        schedule: str = "after",
        timeline: Timeline = NullTimeline(),
        compile: bool = False,
        release_buffers: bool = False,
        gather: Any = NullGather(),
        flat_params: bool = True,
        eager_modules: Any = (),
        around_compiled: Callable[[Callable], Callable] | None = None,
    ):
        schedule = resolve_schedule(schedule, comm.world_size)
        regions = compile and gather.gathers  # stage 3: compiled blocks between eager gathers (fdp.step.compiled)
        if compile and not regions:
            schedule = compiled_schedule(schedule)
        if gather.gathers:  # the params are released bucket by bucket as their gradients complete
            schedule = resolve_schedule("overlap", world_size=2)
        self.plan, self.hook, self.comm, self.schedule, self.timeline = plan, hook, comm, schedule, timeline
        self.release_buffers, self.gather = release_buffers or gather.gathers, gather
        self.loss_fn = self._marking_forward_end(gather.wrap_loss(loss_fn))
        if regions:
            units = region_modules(gather.model.module)
            gather.hold_by(units)
            self.loss_fn = compiled_regions(self.loss_fn, [u for u in units if all(u is not m for m in eager_modules)])
        # Views stay views of the buffers when their memory is released and given back; released ones get
        # memory again when first written (``_start_next``, ``_store``, the tensor hooks).
        if self.release_buffers:
            self.flats, views = bucket_buffers.allocate_released(plan, _slot_views)
        else:
            self.flats = bucket_buffers.allocate(plan)
            views = [_slot_views(bucket, flat) for bucket, flat in zip(plan.buckets, self.flats)]
        self._table = _slot_table(plan, views)
        # The backward runs once torch.func's transform is left (fdp.model.functional.grad_and_value);
        # params laid out one flat buffer per bucket cross the transform as those buffers.
        grad = autograd_grad_and_value if regions else grad_and_value  # torch.func refuses compiled code
        self._plain_grad = grad(self.loss_fn)
        self._hooked_grad = grad(self._traced_loss)
        self._flat_grad = grad(self._flat_loss)
        self._hooked_flat_grad = grad(self._traced_flat_loss)
        if compile and not regions:  # the compiler takes the whole of torch.func's own transform in one graph
            self._plain_grad = compile_grad(func_grad_and_value(self.loss_fn, has_aux=True))
            if around_compiled is not None:  # what runs outside the graph at each call (a micro-batch's stream keys)
                self._plain_grad = around_compiled(self._plain_grad)
        # One compiled path, the params tree's, whatever the params' layout: no second compile.
        # Params sharded by ZeRO keep their own layout (``flat_params=False``).
        self._flat = flat_params and not compile and bucket_buffers.crosses_flat(plan)
        self._seen_flat: tuple[tuple[str, ...], list[weakref.ref]] = ((), [])  # the params last found laid out
        self._keys: tuple[str, ...] = ()  # the params' names in the caller's order
        self._reduction: Reduction | None = None
        self._remaining: list[int] = []
        self._scale = 1.0
        self._accumulate = False
        self._on_reduced: Callable[[int, GradBucket], None] | None = None  # backward's (see ``backward``)

    def backward(
        self,
        params,
        buffers,
        micro_batches: list,
        hook_states: tuple,
        on_reduced: Callable[[int, GradBucket], None] | None = None,
    ) -> Backward:
        """Gradients of the mean loss over ``micro_batches``, their buckets' chains started.

        ``buffers`` flow through the micro-batches in order. Under the ``overlap`` schedule
        the last micro-batch's backward starts each bucket as soon as it is full; the rest
        start here, in plan order, once backward is done. At ZeRO stage 3 every micro-batch's
        buckets are reduced as they fill, their results summed (``reduces_each_micro_batch``).

        ``on_reduced(index, bucket)``, at ZeRO stage 3: each bucket whose chain ends while
        backward still runs (its gradients complete two buckets earlier) is handed to it
        then, not kept to the end (``Backward.reduction`` yields the others): an update that
        steps the bucket's slice at once frees its reduced gradient there, so a rank never
        holds every bucket's slice at once.
        """
        reduction = Reduction(self.hook, self.comm, hook_states, self.plan, self.timeline, release=self.release_buffers)
        self._on_reduced = on_reduced if self.gather.gathers else None
        each = self.gather.gathers and len(micro_batches) > 1 and reduces_each_micro_batch(hook_states)
        try:
            return self._backward(reduction, params, buffers, micro_batches, hook_states if each else None)
        finally:
            self._on_reduced = None

    def _backward(self, reduction: Reduction, params, buffers, micro_batches: list, each: tuple | None) -> Backward:
        """``each``: the hook states a micro-batch before the last reduces its own buckets with, or ``None`` where
        the buckets accumulate over the micro-batches (``reduces_each_micro_batch``)."""
        scale = 1.0 / len(micro_batches)
        losses = []
        flats = self.flat_params(params) if self._flat else None
        for i, batch in enumerate(micro_batches):
            start_us = self.timeline.now_us()
            last = i == len(micro_batches) - 1
            if each is not None and not last:
                loss, aux = self._reduced_alone(params, flats, buffers, batch, reduction, each, scale)
            elif last and self.schedule == "overlap":
                accumulate = i > 0 and each is None
                loss, aux = self._overlapped(params, flats, buffers, batch, reduction, scale, accumulate)
            elif flats is not None:
                grads, (loss, aux) = self._flat_grad(flats, buffers, batch)
                self._store_flat(grads, scale, accumulate=i > 0)
                del grads  # added into the buckets: not alive while the next micro-batch makes its own
            else:
                grads, (loss, aux) = self._plain_grad(params, buffers, batch)
                self._store(grads, scale, accumulate=i > 0)
                del grads
            self.timeline.forward_backward(start_us, micro_batch=i)
            buffers = aux[0] if isinstance(aux, tuple) else buffers
            losses.append(loss)
        while reduction.started < len(self.plan.buckets):
            self._start_next(reduction)
        self.gather.stop()  # every gradient is in: no whole params are needed any more
        return Backward(reduction, losses, buffers)

    def _reduced_alone(self, params, flats, buffers, batch, into: Reduction, states: tuple, scale: float):
        """A micro-batch before the last, its buckets reduced as they fill and the results added into ``into``'s."""
        earlier = Reduction(self.hook, self.comm, states, self.plan, self.timeline, release=True, into=into)
        loss, aux = self._overlapped(params, flats, buffers, batch, earlier, scale, accumulate=False)
        while earlier.started < len(self.plan.buckets):
            self._start_next(earlier)
        for _ in earlier.finished():  # each result goes into ``into``'s: nothing is handed back here
            pass
        self.gather.again()  # the next micro-batch's backward needs every bucket's params again
        return loss, aux

    def _start_next(self, reduction: Reduction) -> None:
        """Start the next bucket's chain (the plan's next, once its gradients are complete)."""
        index = reduction.started
        flat = self.flats[index]
        if self.release_buffers:  # a bucket no gradient reached this step holds zeros
            bucket_buffers.regrow(flat, zero=True)
        self.gather.grads_done(index)
        if self.gather.gathers and index >= 2:  # at most three buckets' gradients in flight, the same on every rank
            reduction.complete(index - 2)
            if self._on_reduced is not None:
                for done, bucket in reduction.take_ready():
                    self._on_reduced(done, bucket)
        reduction.start(flat)

    def flat_params(self, params) -> tuple[torch.Tensor, ...] | None:
        """The flat buffers ``params`` are views of (see ``fdp.plan.buckets.lay_out``), or ``None``.

        The full check looks at every tensor's storage; a step's params are usually the
        very tensors of the step before (updated in place), which a look at their
        identities confirms.
        """
        keys, refs = self._seen_flat
        values = params.values()
        if (
            len(refs) != len(values)
            or any(ref() is not value for ref, value in zip(refs, values))
            or tuple(params) != keys
        ):
            if bucket_buffers.flat_buffers(self.plan, params) is None:
                return None
            self._seen_flat = (tuple(params), [weakref.ref(value) for value in values])
        self._keys = self._seen_flat[0]
        return bucket_buffers.flat_buffers(self.plan, params, known_laid_out=True)

    def laid_out(self, params) -> dict:
        """``params`` laid out one flat buffer per bucket where this reducer hands them over so (a copy if need be)."""
        if not self._flat or self.flat_params(params) is not None:
            return params
        return bucket_buffers.lay_out(self.plan, params)

    def _marking_forward_end(self, loss_fn: LossFn) -> LossFn:
        def marked(*args):
            out = loss_fn(*args)
            self.timeline.mark_forward_end()
            return out

        return marked

    def _store(self, grads: dict, scale: float, accumulate: bool) -> None:
        if self.release_buffers:
            for flat in self.flats:
                bucket_buffers.regrow(flat)
        names = [n for n in self._table.views if n in grads]
        views = [self._table.views[n] for n in names]
        values = [grads[n].reshape(-1) for n in names]
        if accumulate:
            foreach.add_(views, values, alpha=scale)
        else:
            foreach.copy_(views, values)
            if scale != 1.0:
                foreach.mul_(views, scale)

    def _store_flat(self, grads: tuple, scale: float, accumulate: bool) -> None:
        flats = list(self.flats)
        if accumulate:
            foreach.add_(flats, list(grads), alpha=scale)
        else:
            foreach.copy_(flats, list(grads))
            if scale != 1.0:
                foreach.mul_(flats, scale)

    def _flat_loss(self, flats, buffers, batch):
        views: dict[str, torch.Tensor] = {}
        for bucket, flat in zip(self.plan.buckets, flats):
            views.update(zip(bucket._layout[0], bucket_buffers.views_in(bucket, flat)))
        # In the caller's order: a loss that walks the params (a penalty) sums as it would.
        return self.loss_fn({name: views[name] for name in self._keys}, buffers, batch)

    # -- overlap: the buckets fill and launch from inside backward ---------------------

    def _overlapped(self, params, flats, buffers, batch, reduction: Reduction, scale: float, accumulate: bool):
        self._reduction, self._scale, self._accumulate = reduction, scale, accumulate
        self._remaining = list(self._table.sizes) if flats is None else [1] * len(self.flats)
        self._handles = []
        try:
            if flats is None:
                _, (loss, aux) = self._hooked_grad(params, self.flats, buffers, batch)
            else:
                _, (loss, aux) = self._hooked_flat_grad(flats, self.flats, buffers, batch)
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

    def _traced_flat_loss(self, flats, flats_arg, buffers, batch):
        for index, flat in enumerate(flats):
            self._handles.append(flat.register_hook(self._make_bucket_hook(index, flats_arg)))
        return self._flat_loss(flats, buffers, batch)

    def _make_bucket_hook(self, index: int, flats_arg):
        def on_grad_ready(grad):
            # The whole bucket's gradient at once (the backward of views_in's split);
            # written without autograd for the reason _make_tensor_hook gives.
            with torch.no_grad():
                _write(flats_arg[index], grad, self._scale, self._accumulate)
            self._remaining[index] = 0
            self._start_filled()
            # What goes on to the transform's result, which the step drops: a zero of no
            # memory lets this bucket's gradient go now, not one gradient set at the end.
            return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)

        return on_grad_ready

    def _start_filled(self) -> None:
        reduction = self._reduction
        # Hook chains run outside the transform: tensors they create (and keep in
        # their state) must be plain tensors, not this grad level's wrappers.
        with disable_functorch(), torch.no_grad():
            while reduction.started < len(self._remaining) and self._remaining[reduction.started] == 0:
                self._start_next(reduction)

    def _make_tensor_hook(self, name: str, flats_arg, shape: tuple[int, ...]):
        bucket = self._table.bucket[name]
        view_of = self._table.views[name]
        start = view_of.storage_offset() - self.flats[bucket].storage_offset()
        stop = start + view_of.numel()
        flat = self.flats[bucket]
        # With parameter sharding autograd's own copy of the gradient is not kept: a
        # zero-strided scalar takes its place in what torch.func returns.
        # In the dtype of the gradient it stands for: the gathered param's (bf16 under bf16-mixed), not the bucket's.
        dtype = self.gather.views[name].dtype if self.gather.gathers else None
        placeholder = torch.zeros((), dtype=dtype, device=view_of.device) if self.gather.gathers else None

        def on_grad_ready(grad):
            # Copied with autograd on, a gradient that carries a graph (torch.func.grad's
            # create_graph=True) made the bucket record a node saving this step's wrapped
            # params, held through the hooks in a cycle gc cannot break: a gradient-sized
            # set leaked per step. The bucket is never differentiated: no autograd.
            with torch.no_grad():
                if self.release_buffers:
                    bucket_buffers.regrow(flat)
                _write(flats_arg[bucket][start:stop].view(shape), grad, self._scale, self._accumulate)
            self._remaining[bucket] -= 1
            self._start_filled()
            # Returning None keeps autograd's own gradient (returning it again also kept
            # a gradient set alive, through the same cycle).
            return None if placeholder is None else placeholder.expand(shape)

        return on_grad_ready


def _write(target: torch.Tensor, grad: torch.Tensor, scale: float, accumulate: bool) -> None:
    """``target`` = ``scale * grad``, or ``+=`` it when accumulating micro-batches."""
    if accumulate:
        target.add_(grad, alpha=scale)
    elif scale != 1.0 and grad.dtype != target.dtype:  # a bf16 gradient into a float32 bucket: scaled in float32
        target.copy_(grad).mul_(scale)
    elif scale != 1.0:
        torch.mul(grad, scale, out=target)
    else:
        target.copy_(grad)
