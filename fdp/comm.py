"""Collectives as values: launched asynchronously, awaited where a hook needs the result.

Hooks never call ``torch.distributed`` directly. They ask a ``Comm`` for a collective,
get a ``Pending`` back and ``yield`` it when they need its result; the reduction runtime
decides when to resume them, so every rank issues its collectives in the same order.
A ``Comm`` over a world of one completes everything at once, so single-process training
runs the very same code path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class Pending:
    """A collective in flight; ``wait()`` blocks until it is done and returns its result."""

    __slots__ = ("_work", "_result")

    def __init__(self, result: torch.Tensor, work=None):
        self._work, self._result = work, result

    def __getattr__(self, name: str):
        # Only for names a Pending lacks: most often a hook that used a collective's
        # result without yielding it first.
        raise AttributeError(
            f"'Pending' object has no attribute {name!r}: a collective's result exists only once it is done; "
            "in a hook stage write `result = yield comm.allreduce(x)` (yield it), elsewhere call .wait()"
        )

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result


@dataclass
class Comm:
    """Asynchronous collectives over a process group, with a count of bytes sent.

    ``bytes_sent`` counts the payload this rank contributes (the tensor handed to each
    collective), the figure a compression ratio is taken against.

    >>> comm = Comm()            # no process group: a world of one
    >>> comm.allreduce(torch.ones(3)).wait()
    tensor([1., 1., 1.])
    """

    group: dist.ProcessGroup | None = None
    bytes_sent: int = field(default=0)
    collectives: int = field(default=0)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _count(self, tensor: torch.Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.collectives += 1

    def allreduce(self, tensor: torch.Tensor) -> Pending:
        """Sum ``tensor`` over ranks, in place; the caller must own ``tensor``."""
        if self.world_size == 1:
            return Pending(tensor)
        self._count(tensor)
        return Pending(tensor, dist.all_reduce(tensor, group=self.group, async_op=True))

    def allgather(self, tensor: torch.Tensor) -> Pending:
        """Every rank's ``tensor``, stacked: the result has shape ``(world_size, *tensor.shape)``."""
        world = self.world_size
        if world == 1:
            return Pending(tensor.unsqueeze(0).clone())  # a new tensor, as with many ranks
        self._count(tensor)
        out = tensor.new_empty(world * tensor.numel())
        work = _all_gather_flat(out, tensor.contiguous().view(-1), group=self.group, async_op=True)
        return Pending(out.view(world, *tensor.shape), work)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        """Every rank's ``tensor`` becomes rank ``src``'s (``src`` counted in this group), in place."""
        if self.world_size == 1:
            return Pending(tensor)
        if self.rank == src:
            self._count(tensor)
        source = dist.get_global_rank(self.group, src) if self.group is not None else src
        return Pending(tensor, dist.broadcast(tensor, source, group=self.group, async_op=True))

    def take_counters(self) -> tuple[int, int]:
        """Return ``(bytes_sent, collectives)`` since the last call and reset them."""
        counters = (self.bytes_sent, self.collectives)
        self.bytes_sent = self.collectives = 0
        return counters


# torch renamed the flat all-gather (all_gather_into_tensor -> all_gather_single) in 2.13.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
