"""Collectives as values: launched asynchronously, awaited where a hook needs the result.

Hooks never call ``torch.distributed`` directly. They ask a ``Comm`` for a collective,
get a ``Pending`` back and ``yield`` it when they need its result; the reduction runtime
decides when to resume them, so every rank issues its collectives in the same order.
A ``Comm`` over a world of one completes everything at once, so single-process training
runs the very same code path.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from fdp._torch import group_timeout

Watch = Callable[[], None]  # raises RuntimeError once the world a collective runs in is known to be broken
_WATCH_EVERY = datetime.timedelta(milliseconds=50)


def wait_watched(work: Any, watch: Watch | None) -> None:
    """``work.wait()``, asking ``watch`` every 50 ms while the collective is not done.

    A rank whose collective waits on a live peer (which waits on a lost one) would
    otherwise learn of the loss only at the collective's timeout; the first rank to see
    it says so where ``watch`` looks (``fdp.procs.shrink``), and the wait ends at once. Only
    for gloo: NCCL's timed wait blocks the host until the device is done.

    >>> wait_watched(None, None)
    """
    if work is None:
        return
    if watch is None:
        work.wait()
        return
    while True:
        try:
            work.wait(timeout=_WATCH_EVERY)
            return
        except RuntimeError:
            if work.is_completed():
                # Done by now: the timeout was this poll's if the collective finished since, so
                # its own outcome decides (a wait on finished work returns, or raises its failure).
                work.wait()
                return
            watch()


class Pending:
    """A collective in flight; ``wait()`` blocks until it is done and returns its result."""

    __slots__ = ("_work", "_result", "_watch")

    def __init__(self, result: torch.Tensor, work=None, watch: Watch | None = None):
        self._work, self._result, self._watch = work, result, watch

    def __getattr__(self, name: str):
        # Only for names a Pending lacks: most often a hook that used a collective's
        # result without yielding it first.
        raise AttributeError(
            f"'Pending' object has no attribute {name!r}: a collective's result exists only once it is done; "
            "in a hook write `result = yield comm.allreduce(x)` (yield it), elsewhere call .wait()"
        )

    def done(self) -> bool:
        """Whether ``wait()`` would return at once."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            wait_watched(self._work, self._watch)
            self._work = None
        return self._result


@dataclass
class Comm:
    """Asynchronous collectives over a process group, with a count of bytes sent.

    ``bytes_sent`` counts the payload this rank contributes (the tensor handed to each
    collective), the figure a compression ratio is taken against.

    ``watch``: asked while a collective waits (``wait_watched``); ``fdp.procs.shrink`` sets it.

    >>> comm = Comm()            # no process group: a world of one
    >>> comm.allreduce(torch.ones(3)).wait()
    tensor([1., 1., 1.])
    """

    group: dist.ProcessGroup | None = None
    bytes_sent: int = field(default=0)
    collectives: int = field(default=0)
    watch: Watch | None = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _count(self, tensor: torch.Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.collectives += 1

    def _pending(self, result: torch.Tensor, work: Any) -> Pending:
        return Pending(result, work, self.watch)

    def allreduce(self, tensor: torch.Tensor) -> Pending:
        """Sum ``tensor`` over ranks, in place; the caller must own ``tensor``."""
        if self.world_size == 1:
            return Pending(tensor)
        self._count(tensor)
        return self._pending(tensor, dist.all_reduce(tensor, group=self.group, async_op=True))

    def allgather(self, tensor: torch.Tensor) -> Pending:
        """Every rank's ``tensor``, stacked: the result has shape ``(world_size, *tensor.shape)``."""
        world = self.world_size
        if world == 1:
            return Pending(tensor.unsqueeze(0).clone())  # a new tensor, as with many ranks
        self._count(tensor)
        out = tensor.new_empty(world * tensor.numel())
        work = _all_gather_flat(out, tensor.contiguous().view(-1), group=self.group, async_op=True)
        return self._pending(out.view(world, *tensor.shape), work)

    def sum_bucket(self, tensor: torch.Tensor) -> Pending:
        """``allreduce`` of a bucket's values (a hook's name for it: a ZeRO comm reduce-scatters it instead,
        ``fdp.update.zero.scatter``)."""
        return self.allreduce(tensor)

    def gather_bucket(self, tensor: torch.Tensor) -> Pending:
        """``allgather`` of a bucket's values, whose parts the hook sums (a ZeRO comm all-to-alls them instead)."""
        return self.allgather(tensor)

    def bucket_parts(self, numel: int) -> tuple[tuple[int, int], ...]:
        """The ranges of a bucket of ``numel`` elements that ``gather_bucket`` hands out, in the order of its
        input's equal chunks: here one, the whole bucket, which every rank receives (a ZeRO comm: each rank's
        slice, chunk ``j`` going to rank ``j``). A hook whose exchange is not elementwise (codes with per-block
        scales, ``fdp.hooks.lowbit``) lays its input out one chunk per part.

        >>> Comm().bucket_parts(5)
        ((0, 5),)
        """
        return ((0, numel),)

    def kept_range(self, numel: int) -> tuple[int, int]:
        """``(start, stop)`` of a reduced bucket of ``numel`` elements that this rank keeps: here all of it (a ZeRO
        comm: its zero-padded slice). A hook that reduces into the kept range alone is ``Hook.shardable``.

        >>> Comm().kept_range(5)
        (0, 5)
        """
        return 0, numel

    @property
    def whole(self) -> "Comm":
        """The comm whose bucket collectives leave every rank the whole bucket: this one (a ZeRO comm's inner one)."""
        return self

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> Pending:
        """Every rank's ``tensor``, stacked on rank ``dst`` (shape ``(world_size, *tensor.shape)``); ``None`` elsewhere.

        >>> Comm().gather(torch.ones(2)).wait()
        tensor([[1., 1.]])
        """
        world = self.world_size
        if world == 1:
            return Pending(tensor.unsqueeze(0).clone())
        self._count(tensor)
        mine = self.rank == dst
        out = tensor.new_empty((world, *tensor.shape)) if mine else None
        target = dist.get_global_rank(self.group, dst) if self.group is not None else dst
        work = dist.gather(
            tensor.contiguous(), list(out.unbind(0)) if mine else None, dst=target, group=self.group, async_op=True
        )
        return self._pending(out, work)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        """Every rank's ``tensor`` becomes rank ``src``'s (``src`` counted in this group), in place."""
        if self.world_size == 1:
            return Pending(tensor)
        if self.rank == src:
            self._count(tensor)
        source = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._pending(tensor, dist.broadcast(tensor, source, group=self.group, async_op=True))

    def reduce_scatter(self, tensor: torch.Tensor) -> Pending:
        """Sum the flat ``tensor`` over ranks; this rank gets its ``1/world_size`` slice, a new tensor.

        ``tensor``'s length must be a multiple of the world size, and the caller must own it.
        gloo has no reduce-scatter of its own: torch runs one there as an all-reduce of a
        copy of the input (the whole tensor's traffic, and one more tensor of memory per
        collective in flight: +100 MiB per rank on a 25M-parameter model). On gloo this
        all-reduces ``tensor`` in place instead, the same bytes without the copy, and
        returns a view of this rank's slice; elsewhere (NCCL) it is the native collective.

        >>> Comm().reduce_scatter(torch.arange(4.0)).wait()
        tensor([0., 1., 2., 3.])
        """
        world = self.world_size
        if tensor.numel() % world:
            raise ValueError(f"reduce_scatter: {tensor.numel()} elements do not split over {world} ranks")
        if world == 1:
            return Pending(tensor)
        self._count(tensor)
        size = tensor.numel() // world
        if dist.get_backend(self.group) == "gloo":
            flat = tensor.view(-1)
            mine = flat[self.rank * size : (self.rank + 1) * size]
            return self._pending(mine, dist.all_reduce(flat, group=self.group, async_op=True))
        out = tensor.new_empty(size)
        return self._pending(
            out, _reduce_scatter_flat(out, tensor.contiguous().view(-1), group=self.group, async_op=True)
        )

    def all_to_all(self, tensor: torch.Tensor) -> Pending:
        """Chunk ``j`` of the flat ``tensor`` goes to rank ``j``; row ``r`` of the result came from rank ``r``.

        The result has shape ``(world_size, numel / world_size)``: every rank's copy of
        this rank's chunk, so that summing over the first dimension reduces chunk by
        chunk (a reduce-scatter in any dtype).

        >>> Comm().all_to_all(torch.arange(4)).wait()
        tensor([[0, 1, 2, 3]])
        """
        world = self.world_size
        if tensor.numel() % world:
            raise ValueError(f"all_to_all: {tensor.numel()} elements do not split over {world} ranks")
        if world == 1:
            return Pending(tensor.reshape(1, -1).clone())
        self._count(tensor)
        out = tensor.new_empty(tensor.numel())
        work = dist.all_to_all_single(out, tensor.contiguous().view(-1), group=self.group, async_op=True)
        return self._pending(out.view(world, -1), work)

    def all_gather_into(self, out: torch.Tensor, piece: torch.Tensor) -> Pending:
        """Fill the flat ``out`` with every rank's ``piece``, in rank order; ``out`` has ``world_size`` pieces.

        ``piece`` may be this rank's own slice of ``out`` (nothing is copied then). gloo's
        all-gather stages the whole output in a temporary (measured: +100 MiB of peak
        memory for a 100 MiB output); on gloo each rank broadcasts its slice of ``out``
        in place instead: the same bytes, no temporary, and no slower (420 vs 830 ms for
        100 MiB over 2 loopback ranks). Elsewhere (NCCL) it is the native collective.

        >>> out = torch.zeros(2)
        >>> Comm().all_gather_into(out, torch.tensor([1.0, 2.0])).wait()
        tensor([1., 2.])
        """
        world = self.world_size
        if out.numel() != world * piece.numel():
            raise ValueError(f"all_gather_into: {out.numel()} elements are not {world} pieces of {piece.numel()}")
        if world == 1:
            with torch.no_grad():
                out.copy_(piece.view(-1))
            return Pending(out)
        self._count(piece)
        if dist.get_backend(self.group) == "gloo":
            chunks = out.view(-1).chunk(world)
            mine = chunks[self.rank]
            if mine.data_ptr() != piece.data_ptr():
                with torch.no_grad():
                    mine.copy_(piece.view(-1))
            ranks = dist.get_process_group_ranks(self.group) if self.group is not None else range(world)
            works = [
                dist.broadcast(chunk, src=src, group=self.group, async_op=True) for chunk, src in zip(chunks, ranks)
            ]
            return self._pending(out, _AllOf(works))
        return self._pending(out, _all_gather_flat(out, piece.contiguous().view(-1), group=self.group, async_op=True))

    def on_own_group(self) -> "Comm":
        """A ``Comm`` over the same ranks on a process group of its own.

        Every rank must call it, at the same point: torch makes groups collectively.

        Collectives on different groups neither wait for each other nor need a common
        order: a reduction left in flight across steps goes on its own group, so the
        collectives the steps issue meanwhile cannot cross it.
        """
        if self.world_size == 1:
            return Comm()
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.world_size))
        return Comm(new_group(ranks), watch=self.watch)

    def take_counters(self) -> tuple[int, int]:
        """Return ``(bytes_sent, collectives)`` since the last call and reset them."""
        counters = (self.bytes_sent, self.collectives)
        self.bytes_sent = self.collectives = 0
        return counters


class Alone(Comm):
    """A world of one inside a larger one: every collective completes at once, unsent (an outer loop's
    replica stepping on its own between syncs, ``fdp.step.outer``).

    >>> Alone().world_size, Alone().allreduce(torch.ones(2)).wait().tolist()
    (1, [1.0, 1.0])
    """

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` with the default group's timeout (every rank must call it, in one order).

    torch gives a new group its own default timeout (30 minutes on gloo), not the one
    the world was started with; fdp's groups time out as the world does.
    """
    return dist.new_group(ranks, timeout=group_timeout())


class _AllOf:
    """Several collectives awaited as one."""

    __slots__ = ("_works",)

    def __init__(self, works: list):
        self._works = works

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout=timeout)


# torch renamed the flat all-gather (all_gather_into_tensor -> all_gather_single) in 2.13.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
