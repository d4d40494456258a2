"""The hook interface: pure transforms of gradient reduction, composed like optax's.

A hook is a pair of functions:

* ``init(bucket) -> state``: the state for one bucket of the plan (a NamedTuple, ``()``
  when there is none). Each bucket has its own state, so buckets reduce independently.
* ``apply(state, grads, comm) -> (grads, state)``: transform one bucket's flat gradient.
  ``grads`` is a ``GradBucket``; ``apply`` modifies its buffer only when the bucket says
  it ``owns`` it (the runtime's own scratch buffers), and otherwise returns new tensors.
  A hook that needs a collective asks ``comm`` for it and ``yield``-s the
  ``Pending`` it gets back where it needs the result::

      def apply(state, grads, comm):
          summed = yield comm.allreduce(grads.buffer / comm.world_size)
          return grads._replace(buffer=summed), state

  The runtime resumes the generator when the collective is done. Yielding is what lets
  many buckets (and many collectives per bucket) be in flight at once while every rank
  still issues its collectives in one order, fixed by the plan.

``chain(*hooks)`` runs hooks one after another on the same bucket and keeps a tuple of
their states, so ``chain(fp16_compress(), allreduce(), fp16_decompress())`` is a hook too.

A hook hands per-bucket data to a later hook of the same chain in ``GradBucket.side``
(a quantisation scale from a compressing hook to its decompressing one): part of the
bucket value, so nothing is kept in a closure. What must outlive the step (an error
residual) belongs in the hook's state, which is checkpointed.

Every hook's result is checked as it comes back: a hook that returns the bucket alone,
yields something that is not a collective, or puts a ``Pending`` (a collective it forgot
to ``yield``) where the gradient belongs fails with a ``TypeError`` naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable, Generator, NamedTuple, Union

import torch

from fdp.comm import Comm, Pending
from fdp.plan import Bucket

_NO_SIDE: Mapping[str, Any] = MappingProxyType({})

HookResult = Union[tuple["GradBucket", Any], Generator[Pending, torch.Tensor, tuple["GradBucket", Any]]]


class GradBucket(NamedTuple):
    """One bucket's gradients on their way through a hook chain.

    ``buffer`` is flat and laid out as ``spec`` says; it holds this rank's gradient, not
    yet divided by the world size (as in DDP's comm hooks). A compressing hook may
    replace it by a tensor of another dtype; ``spec`` always describes the original.

    ``owned`` says the chain may overwrite ``buffer``: the runtime hands its scratch
    bucket buffers over that way (refilled every step), and a hook that makes a new
    buffer passes it on owned. Hooks then work in place (an allreduce divides the
    buffer it is given instead of a copy); with ``owned=False`` (the default, for
    buffers a caller still needs) the input is never touched.

    ``side`` carries data from one hook to later hooks of the same chain, for this
    bucket and this step (``int8_compress`` leaves its scale there for
    ``int8_decompress``). A hook adds to it by returning
    ``grads._replace(side={**grads.side, "key": value})``, never by changing the
    mapping it was given.

    >>> from fdp.plan import ParamSlot
    >>> spec = Bucket(0, "float32", "cpu", (ParamSlot("w", (2,), 0, 2),), 2)
    >>> grads = GradBucket(0, torch.ones(2), spec)
    >>> dict(grads._replace(side={**grads.side, "scale": 0.5}).side)
    {'scale': 0.5}
    """

    index: int
    buffer: torch.Tensor
    spec: Bucket
    owned: bool = False
    side: Mapping[str, Any] = _NO_SIDE


class Hook(NamedTuple):
    """One transform of gradient reduction: ``init(bucket) -> state``, ``apply(state, grads, comm) -> (grads, state)``.

    ``shardable`` declares that the hook reduces straight into the part of the bucket a
    comm says this rank keeps (``comm.kept_range``: everything over a plain comm, the
    rank's slice where ZeRO stages 2 and 3 scatter the bucket, ``fdp.update.zero``): its
    collectives of the bucket's values are sums (``comm.sum_bucket``) or gathers whose
    parts it sums (``comm.gather_bucket``, as ``int8_sum``), named as such so that a
    scattering comm knows them from its other collectives (a scale, a maximum), or it
    sums gathered entries into the kept range alone (``topk``); everything after them is
    elementwise. A hook that does not say (``False``, the default) makes the whole
    reduced bucket, and where a rank keeps only a slice, ``for_slices`` runs it over the
    comm's ``whole`` and keeps the slice (PowerSGD, whose low-rank factors are whole).
    """

    init: Callable[[Bucket], Any]
    apply: Callable[[Any, GradBucket, Comm], HookResult]
    shardable: bool = False


def drive_hook(result: HookResult):
    """Drive a hook's ``apply`` result from inside another generator (``yield from``)."""
    if inspect.isgenerator(result):
        return (yield from result)
    return result


def hook_name(hook: Hook) -> str:
    """The name a hook goes by in error messages: the factory that made it (``powersgd``).

    >>> from fdp.hooks import powersgd
    >>> hook_name(powersgd())
    'powersgd'
    """
    name = getattr(hook.apply, "__qualname__", None) or type(hook.apply).__name__
    return name.split(".<locals>")[0]


def _describe(value: Any) -> str:
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def _check_result(result: Any, where: str) -> tuple[GradBucket, Any]:
    if isinstance(result, GradBucket):
        raise TypeError(
            f"{where} returned the GradBucket alone: a Hook's apply returns (grads, state) "
            "(wrap a hook without state in fdp.hooks.stateless)"
        )
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], GradBucket)):
        raise TypeError(f"{where} returned {_describe(result)}: expected a (GradBucket, state) pair")
    _check_buffer(result[0].buffer, where)
    return result


def _check_buffer(buffer: Any, where: str) -> None:
    if isinstance(buffer, Pending):
        raise TypeError(
            f"{where} put a Pending collective in the bucket instead of its result: "
            "yield it to wait for the result (summed = yield comm.allreduce(x))"
        )
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{where} returned a bucket whose buffer is {_describe(buffer)}: expected a flat tensor")


def _run_with_checks(hook: Hook, state: Any, grads: GradBucket, comm: Comm, where: str):
    """``hook.apply`` driven as ``drive_hook`` does, with what it yields and returns checked."""
    run = hook.apply(state, grads, comm)
    if inspect.isgenerator(run):
        value = None
        while True:
            try:
                pending = run.send(value)
            except StopIteration as done:
                run = done.value
                break
            if not isinstance(pending, Pending):
                raise TypeError(
                    f"{where} yielded {_describe(pending)}: a hook yields only the Pending a Comm "
                    "collective returns (summed = yield comm.allreduce(x))"
                )
            value = yield pending
    return _check_result(run, where)


def with_result_checks(hook: Hook) -> Hook:
    """``hook`` with its results checked (the train step runs every hook through this).

    >>> from fdp.hooks import allreduce
    >>> hook = with_result_checks(allreduce())
    """
    where = f"hook {hook_name(hook)}"

    def apply(state: Any, grads: GradBucket, comm: Comm):
        return (yield from _run_with_checks(hook, state, grads, comm, where))

    apply.__qualname__ = hook_name(hook)
    return Hook(hook.init, apply, hook.shardable)


def for_slices(hook: Hook) -> Hook:
    """``hook`` as a comm that keeps only part of each reduced bucket runs it (``comm.kept_range``).

    A ``shardable`` hook reduces into the kept part itself and is returned as it is. Any
    other runs over the comm's ``whole`` (every bucket collective whole, as at ZeRO stage
    0) and this rank keeps its part of the result, zero-padded: the whole reduced bucket
    lives until that copy is made, one bucket per chain in flight (the reduction's
    buckets in flight, not the model's gradient). Over a plain comm both are ``hook``
    itself. The state is the hook's own, whole: what it keeps per bucket (an error
    feedback residual) is as large as at stage 0.

    >>> from fdp.hooks import powersgd
    >>> sliced = for_slices(powersgd())
    >>> sliced.shardable, hook_name(sliced)
    (True, 'powersgd')
    """
    if hook.shardable:
        return hook

    def apply(state: Any, grads: GradBucket, comm: Comm):
        reduced, state = yield from drive_hook(hook.apply(state, grads, comm.whole))
        start, stop = comm.kept_range(grads.spec.numel)
        whole = reduced.buffer.reshape(-1)
        if (start, stop) == (0, whole.numel()):
            return reduced, state
        part = whole[start:stop]
        padding = part.new_zeros(stop - start - part.numel())
        return reduced._replace(buffer=torch.cat([part, padding]), owned=True), state

    apply.__qualname__ = hook_name(hook)
    return Hook(hook.init, apply, True)


def check_hooks(hooks: tuple, where: str) -> None:
    """Refuse anything but ``Hook`` values, naming the position (optimizers have their own ``fdp.chain``)."""
    for i, hook in enumerate(hooks):
        if isinstance(hook, Hook):
            continue
        if hasattr(hook, "update") and hasattr(hook, "init"):
            raise TypeError(
                f"{where} argument {i} is an optimizer (GradientTransformation), not a hook: "
                "optimizers compose with fdp.chain (fdp.optim.chain), reduction hooks with fdp.hooks.chain"
            )
        if callable(hook) and not isinstance(hook, tuple):
            raise TypeError(
                f"{where} argument {i} is the function {getattr(hook, '__name__', hook)!r}, not a hook: "
                "call the factory (allreduce(), not allreduce), or wrap a function "
                "apply(grads, comm) in fdp.hooks.stateless"
            )
        raise TypeError(f"{where} argument {i} is {_describe(hook)}: expected a Hook (init, apply)")


def chain(*hooks: Hook, name: str = "chain") -> Hook:
    """Compose hooks left to right; the state is the tuple of their states. ``name``: what errors call it
    (``hook_name``), the factory's own where a hook is a chain inside (``lowbit``).

    >>> from fdp.hooks import allreduce, fp16_compress, fp16_decompress
    >>> hook_name(chain(fp16_compress(), allreduce(), fp16_decompress()))
    'chain'
    """
    if not hooks:
        raise ValueError("chain() needs at least one hook")
    check_hooks(hooks, "fdp.hooks.chain:")
    wheres = tuple(f"hook chain[{i}] ({hook_name(hook)})" for i, hook in enumerate(hooks))

    def init(bucket: Bucket) -> tuple:
        return tuple(hook.init(bucket) for hook in hooks)

    def apply(states: tuple, grads: GradBucket, comm: Comm):
        if not isinstance(states, tuple) or len(states) != len(hooks):
            raise TypeError(
                f"hook chain of {len(hooks)} hooks got the state {_describe(states)} for bucket {grads.index}: "
                "expected one state per hook, as chain(...).init(bucket) makes"
            )
        new_states = []
        for hook, state, where in zip(hooks, states, wheres):
            grads, state = yield from _run_with_checks(hook, state, grads, comm, where)
            new_states.append(state)
        return grads, tuple(new_states)

    apply.__qualname__ = name
    return Hook(init, apply, all(hook.shardable for hook in hooks))


def stateless(apply: Callable[[GradBucket, Comm], Any], shardable: bool = False) -> Hook:
    """A hook with no state from a function ``apply(grads, comm)`` (which may yield).

    ``apply`` returns the new ``GradBucket`` alone; ``shardable`` as for ``Hook``.
    """
    where = f"stateless hook {getattr(apply, '__qualname__', apply)!r}"

    def init(bucket: Bucket) -> tuple:
        return ()

    def apply_with_state(state: tuple, grads: GradBucket, comm: Comm):
        out = yield from drive_hook(apply(grads, comm))
        if not isinstance(out, GradBucket):
            if isinstance(out, tuple) and out and isinstance(out[0], GradBucket):
                raise TypeError(f"{where} returned {_describe(out)}: a stateless hook returns the GradBucket alone")
            _check_buffer(out, where)  # a forgotten yield names itself
            raise TypeError(f"{where} returned {_describe(out)}: expected a GradBucket")
        return out, state

    apply_with_state.__qualname__ = getattr(apply, "__qualname__", "stateless")
    return Hook(init, apply_with_state, shardable)


def expect_floating(grads: GradBucket, name: str) -> None:
    """Refuse a bucket that is not floating point where the hook ``name`` averages it."""
    if not grads.buffer.is_floating_point():
        raise TypeError(
            f"hook {name} got bucket {grads.index} as {grads.buffer.dtype}: it averages floating-point "
            "buckets only (an integer sum over ranks overflows or truncates); put the hook that "
            "decompresses before it, or sum integers in a wider type (see fdp.hooks.int8_sum)"
        )


def init_hook_states(hook: Hook, plan) -> tuple:
    """One state of ``hook`` per bucket of ``plan`` (a ``BucketPlan``), in plan order.

    >>> from fdp.hooks import int8
    >>> from fdp.plan import pack_into_buckets
    >>> buckets = pack_into_buckets([("w", (3,), "float32", "cpu")])
    >>> [state.error.shape for state, _, _ in init_hook_states(int8(), buckets)]
    [torch.Size([3])]
    """
    return tuple(hook.init(bucket) for bucket in plan.buckets)


def run_hook(hook: Hook, state: Any, grads: GradBucket, comm: Comm) -> tuple[GradBucket, Any]:
    """Run one bucket through ``hook`` to the end, waiting on each collective in turn.

    The runtime keeps many buckets in flight instead (``fdp.step.reduce``); this is for tests,
    notebooks and single buckets.
    """
    result = hook.apply(state, grads, comm)
    if not inspect.isgenerator(result):
        return result
    try:
        pending = next(result)
        while True:
            pending = result.send(pending.wait())
    except StopIteration as done:
        return done.value
