"""One step's bucket hook chains in flight: started in plan order, resumed as their
collectives finish, handed back in plan order (``Reduction``).

``fdp.step.reduce`` starts a bucket's chain the moment its gradient is packed (during backward
under the ``overlap`` schedule); the outer loop (``fdp.step.outer``) starts its pseudo-gradient's
chains the same way. Every rank issues the same collectives in the same sequence.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Iterator, NamedTuple

import torch

from fdp.comm import Comm
from fdp.hooks.base import GradBucket, Hook
from fdp.plan import BucketPlan
from fdp.plan import buckets as bucket_buffers
from fdp.trace import NullTimeline, Timeline

__all__ = ["Reduction", "ReduceStats"]


class ReduceStats(NamedTuple):
    """What one step's reduction cost: seconds blocked on communication, bytes this rank sent."""

    wait_s: float
    bytes_sent: int
    collectives: int


class Reduction:
    """The hook chains of one step's buckets: started in plan order, handed back as they finish.

    ``start`` launches the next bucket's chain (from inside backward under the overlap
    schedule); ``finished()`` then yields ``(index, reduced GradBucket)`` for each bucket
    as soon as its chain is done, while later buckets are still in flight, so the caller
    can use one bucket's result (step its params) as the network works on the rest.
    Pending collectives are awaited round by round in plan order, so every rank resumes
    its chains, and issues their next collectives, in the same order.

    >>> from fdp.hooks import allreduce
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2,), "float32", "cpu")])
    >>> reduction = Reduction(allreduce(), Comm(), ((),), plan)
    >>> reduction.start(torch.ones(2))
    >>> [(index, bucket.buffer.tolist()) for index, bucket in reduction.finished()]
    [(0, [1.0, 1.0])]

    A reduction made ``into`` a step's is an earlier micro-batch's (ZeRO stage 3 reduces
    each micro-batch's buckets as they fill, ``fdp.step.reduce``): it hands nothing back,
    its results are added into what the step's hands back for the same buckets.

    >>> step = Reduction(allreduce(), Comm(), ((),), plan)
    >>> earlier = Reduction(allreduce(), Comm(), ((),), plan, into=step)
    >>> earlier.start(torch.ones(2))
    >>> list(earlier.finished())
    []
    >>> step.start(torch.ones(2))
    >>> [bucket.buffer.tolist() for _, bucket in step.finished()]
    [[2.0, 2.0]]
    """

    def __init__(
        self,
        hook: Hook,
        comm: Comm,
        states: tuple,
        plan: BucketPlan,
        timeline: Timeline = NullTimeline(),
        release: bool = False,
        into: "Reduction | None" = None,
    ):
        self._hook, self._comm, self._states, self._plan, self._timeline = hook, comm, states, plan, timeline
        self._release = release  # free each bucket buffer once its chain has handed back a result of its own
        # An earlier micro-batch's reduction of the same step: each result is added into ``into``'s, not handed back.
        self._into = into
        self._carried: dict[int, torch.Tensor] = {}  # bucket index -> earlier micro-batches' results, summed
        self._flats: dict[int, torch.Tensor] = {}
        self._running: dict[int, tuple[Any, Any]] = {}  # bucket index -> (generator, pending collective)
        self._ready: list[tuple[int, GradBucket]] = []  # finished, not yet handed back
        self._new_states: list[Any] = [None] * len(plan.buckets)
        self._issued: dict[int, int] = {}  # bucket index -> collectives issued so far
        self._round: list[int] = []  # chains still to resume in this round, in plan order
        self._wait_s = 0.0
        self.started = 0
        if into is None:
            comm.take_counters()  # this reduction's traffic starts from zero (a step's micro-batches' count together)

    def start(self, flat: torch.Tensor) -> None:
        """Start the next bucket's chain (buckets start strictly in plan order)."""
        index = self.started
        self.started += 1
        self._flats[index] = flat
        self._timeline.bucket_begin(index)
        # The bucket buffer is scratch the reducer refills every step: the chain may work in it.
        grads = GradBucket(index, flat, self._plan.buckets[index], owned=True)
        run = self._hook.apply(self._states[index], grads, self._comm)
        if inspect.isgenerator(run):
            self._advance(index, run, None)
        else:
            self._finished(index, run)

    def finished(self) -> Iterator[tuple[int, GradBucket]]:
        """Yield ``(index, reduced bucket)`` as each chain completes, until every bucket has."""
        self._check_all_started()
        yield from self._handed_back()
        while self._running:
            index = self._next_to_resume()
            run, pending = self._running[index]
            t0 = time.perf_counter()
            value = pending.wait()
            self._wait_s += time.perf_counter() - t0
            self._resume(index, run, value)
            yield from self._handed_back()
        if self._into is not None:  # the step's time blocked counts every micro-batch's
            self._into._wait_s, self._wait_s = self._into._wait_s + self._wait_s, 0.0

    def take_ready(self) -> Iterator[tuple[int, GradBucket]]:
        """Yield ``(index, reduced bucket)`` for each chain done by now, without waiting on any (what ``finished()``
        would yield first); the rest come from ``finished()``."""
        yield from self._handed_back()

    def complete(self, index: int) -> None:
        """Drive bucket ``index``'s chain to its end now, waiting on each of its collectives.

        Every rank must call it at the same point of its step (ZeRO stage 3 finishes each
        bucket two buckets later, inside backward), so that all issue the same sequence.
        """
        while index in self._running:
            run, pending = self._running[index]
            t0 = time.perf_counter()
            value = pending.wait()
            self._wait_s += time.perf_counter() - t0
            if index in self._round:
                self._round.remove(index)
            self._timeline.collective_end(index, self._issued[index])
            self._advance(index, run, value)

    def poll(self) -> None:
        """Resume the chains whose collectives are done, without blocking, as ``finished()`` would.

        For a reduction left in flight while other work runs: chains go on (and issue
        their next collectives) in exactly the order ``finished()`` resumes them, stopping
        at the first collective still on the wire, so every rank issues the same sequence
        however far each one's polls got. Finished buckets wait for ``finished()``.
        """
        self._check_all_started()
        while self._running:
            index = self._next_to_resume()
            run, pending = self._running[index]
            if not pending.done():
                return
            self._resume(index, run, pending.wait())

    @property
    def hook_states(self) -> tuple:
        """The chains' new states, in plan order (once ``finished()`` is exhausted)."""
        return tuple(self._new_states)

    def stats(self) -> ReduceStats:
        """Seconds blocked on collectives, and what this rank sent, since the reduction began."""
        sent, count = self._comm.take_counters()
        return ReduceStats(self._wait_s, sent, count)

    def _check_all_started(self) -> None:
        if self.started != len(self._plan.buckets):
            raise RuntimeError(f"{len(self._plan.buckets) - self.started} buckets were never started")

    def _next_to_resume(self) -> int:
        # Rounds: every running chain in plan order, then again; a chain resumed in one
        # round waits for the next, however soon its next collective is done.
        if not self._round:
            self._round = sorted(self._running)
        return self._round[0]

    def _resume(self, index: int, run, value) -> None:
        self._round.remove(index)
        self._timeline.collective_end(index, self._issued[index])
        self._advance(index, run, value)

    def _handed_back(self) -> Iterator[tuple[int, GradBucket]]:
        while self._ready:
            yield self._ready.pop(0)

    def _finished(self, index: int, result: tuple[GradBucket, Any]) -> None:
        reduced, self._new_states[index] = result
        self._running.pop(index, None)
        flat = self._flats.pop(index)
        apart = reduced.buffer.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        if self._release and apart:
            bucket_buffers.release(flat)
        if self._into is not None:  # the bucket buffer is refilled by the next micro-batch: a result in it is copied
            self._into._carry(index, reduced.buffer if apart else reduced.buffer.clone())
        else:
            carried = self._carried.pop(index, None)
            if carried is not None:
                reduced = reduced._replace(buffer=carried.add_(reduced.buffer), owned=True)
            self._ready.append((index, reduced))
        self._timeline.bucket_end(index)

    def _carry(self, index: int, result: torch.Tensor) -> None:
        held = self._carried.get(index)
        self._carried[index] = result if held is None else held.add_(result)

    def _advance(self, index: int, run, value) -> None:
        try:
            pending = run.send(value)
        except StopIteration as finished:
            self._finished(index, finished.value)
            return
        self._running[index] = (run, pending)
        issued = self._issued[index] = self._issued.get(index, 0) + 1
        self._timeline.collective_begin(index, issued)
