"""The hook interface: pure gradient-reduction stages composed like optax transforms.

A hook is a pair of functions:

* ``init(bucket) -> state``: the state for one bucket of the plan (a NamedTuple, ``()``
  when there is none). Each bucket has its own state, so buckets reduce independently.
* ``apply(state, grads, comm) -> (grads, state)``: transform one bucket's flat gradient.
  ``grads`` is a ``GradBucket``; ``apply`` modifies its buffer only when the bucket says
  it ``owns`` it (the runtime's own scratch buffers), and otherwise returns new tensors.
  A stage that needs a collective asks ``comm`` for it and ``yield``-s the
  ``Pending`` it gets back where it needs the result::

      def apply(state, grads, comm):
          summed = yield comm.allreduce(grads.buffer / comm.world_size)
          return grads._replace(buffer=summed), state

  The runtime resumes the generator when the collective is done. Yielding is what lets
  many buckets (and many collectives per bucket) be in flight at once while every rank
  still issues its collectives in one order, fixed by the plan.

``chain(*hooks)`` runs hooks one after another on the same bucket and keeps a tuple of
their states, so ``chain(fp16_compress(), allreduce(), fp16_decompress())`` is a hook too.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Generator, NamedTuple, Union

import torch

from fdp.comm import Comm, Pending
from fdp.plan import Bucket

HookRun = Union[tuple["GradBucket", Any], Generator[Pending, torch.Tensor, tuple["GradBucket", Any]]]


class GradBucket(NamedTuple):
    """One bucket's gradients on their way through a hook chain.

    ``buffer`` is flat and laid out as ``spec`` says; it holds this rank's gradient, not
    yet divided by the world size (as in DDP's comm hooks). A compressing stage may
    replace it by a tensor of another dtype; ``spec`` always describes the original.

    ``owned`` says the chain may overwrite ``buffer``: the runtime hands its scratch
    bucket buffers over that way (refilled every step), and a stage that makes a new
    buffer passes it on owned. Stages then work in place (an allreduce divides the
    buffer it is given instead of a copy); with ``owned=False`` (the default, for
    buffers a caller still needs) the input is never touched.
    """

    index: int
    buffer: torch.Tensor
    spec: Bucket
    owned: bool = False


class Hook(NamedTuple):
    """A gradient-reduction stage: ``init(bucket) -> state``, ``apply(state, grads, comm) -> (grads, state)``."""

    init: Callable[[Bucket], Any]
    apply: Callable[[Any, GradBucket, Comm], HookRun]


def run_stage(result: HookRun):
    """Drive a hook's ``apply`` result from inside another generator (``yield from``)."""
    if inspect.isgenerator(result):
        return (yield from result)
    return result


def chain(*hooks: Hook) -> Hook:
    """Compose hooks left to right; the state is the tuple of their states.

    >>> from fdp.hooks import allreduce, fp16_compress, fp16_decompress
    >>> hook = chain(fp16_compress(), allreduce(), fp16_decompress())
    """
    if not hooks:
        raise ValueError("chain() needs at least one hook")

    def init(bucket: Bucket) -> tuple:
        return tuple(hook.init(bucket) for hook in hooks)

    def apply(states: tuple, grads: GradBucket, comm: Comm):
        new_states = []
        for hook, state in zip(hooks, states):
            grads, state = yield from run_stage(hook.apply(state, grads, comm))
            new_states.append(state)
        return grads, tuple(new_states)

    return Hook(init, apply)


def stateless(apply: Callable[[GradBucket, Comm], Any]) -> Hook:
    """A hook with no state from a function ``apply(grads, comm)`` (which may yield)."""

    def init(bucket: Bucket) -> tuple:
        return ()

    def apply_with_state(state: tuple, grads: GradBucket, comm: Comm):
        out = yield from run_stage(apply(grads, comm))
        return out, state

    return Hook(init, apply_with_state)


def run_hook(hook: Hook, state: Any, grads: GradBucket, comm: Comm) -> tuple[GradBucket, Any]:
    """Run one bucket through ``hook`` to the end, waiting on each collective in turn.

    The runtime keeps many buckets in flight instead (``fdp.reduce``); this is for tests,
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
