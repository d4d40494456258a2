"""The comm a hook chain reduces over under ZeRO stages 2 and 3: each rank ends with its slice.

A shardable hook chain (``Hook.shardable``) sums a bucket's values with
``comm.sum_bucket`` or gathers them with ``comm.gather_bucket`` and sums the parts
(``int8_sum``, ``lowbit_sum``). Over a ``ScatterComm`` those named calls become the collectives that
leave each rank only what it steps:

* ``sum_bucket(bucket)`` is a reduce-scatter: this rank's slice of the sum
  (``ceil(n / N)`` elements, the bucket zero-padded to ``N`` equal slices). gloo has no
  reduce-scatter of its own (torch runs one there as an all-reduce of a copy): on gloo
  the bucket is all-reduced in place, unpadded, exactly as stage 0 all-reduces it, and
  this rank's slice copied out, so stages 2 and 3 sum every element in the order stage 0
  does (to the bit) and send the same bytes. NCCL runs its native reduce-scatter;
* ``gather_bucket(bucket)`` is an all-to-all: every rank's copy of this rank's slice,
  shape ``(N, ceil(n / N))``, so summing over the first dimension gives this rank's slice
  of the sum, in any dtype (int8 buckets are summed in int32 that way).

Everything else (``allreduce``, ``allgather``: a scale, a maximum) goes to the ranks as
usual, whatever its length: a 1-element maximum is never taken for a 1-element bucket.
A hook that reduces into the slice alone asks which one it keeps (``kept_range``; the
parts ``gather_bucket`` hands out: ``bucket_parts``); one that makes the whole reduced
bucket (PowerSGD) runs over ``whole``, the inner comm, and keeps its slice
(``fdp.hooks.for_slices``).

>>> from fdp.comm import Comm
>>> from fdp.plan import pack_into_buckets
>>> comm = ScatterComm(Comm(), pack_into_buckets([("w", (3,), "float32", "cpu")]))
>>> comm.sum_bucket(torch.ones(3)).wait()  # a world of one: this rank's slice is everything
tensor([1., 1., 1.])
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fdp.comm import Comm, Pending
from fdp.plan import BucketPlan
from fdp.update.zero.layout import padded_slice

__all__ = ["ScatterComm"]


class _OwnSlice(Pending):
    """This rank's slice of a summed bucket, in memory of its own, so that the bucket can be released.

    ``inner`` gives either the slice (a native reduce-scatter) or the whole summed bucket
    (gloo's in-place all-reduce), of which the slice ``[start, stop)`` is copied out, zero
    past the bucket's end.
    """

    __slots__ = ("_inner", "_bucket", "_range")

    def __init__(self, inner: Pending, bucket: torch.Tensor, start: int, stop: int):
        super().__init__(bucket)
        self._inner, self._bucket, self._range = inner, bucket, (start, stop)

    def done(self) -> bool:
        return self._inner is None or self._inner.done()

    def wait(self) -> torch.Tensor:
        if self._inner is not None:
            summed, (start, stop) = self._inner.wait(), self._range
            if (
                summed.numel() == stop - start
                and summed.untyped_storage().data_ptr() != self._bucket.untyped_storage().data_ptr()
            ):
                piece = summed  # a native reduce-scatter's own output
            else:
                piece = padded_slice(summed, start, stop, copy=True)
            self._result, self._inner, self._bucket = piece, None, None
        return self._result


class ScatterComm:
    """A ``Comm`` whose bucket collectives leave each rank its slice (see the module docstring).

    ``plan`` is the plan whose buckets the chain reduces (kept for what the slices are of).
    """

    def __init__(self, comm: Comm, plan: BucketPlan):
        self.inner, self.group, self.plan = comm, comm.group, plan

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def rank(self) -> int:
        return self.inner.rank

    def _padded(self, tensor: torch.Tensor) -> torch.Tensor:
        size = math.ceil(tensor.numel() / self.world_size)
        return padded_slice(tensor.reshape(-1), 0, size * self.world_size)

    def sum_bucket(self, tensor: torch.Tensor) -> Pending:
        """This rank's slice of the bucket's sum over the ranks (a reduce-scatter)."""
        world = self.world_size
        size = math.ceil(tensor.numel() / world)
        start, stop = self.rank * size, (self.rank + 1) * size
        if world == 1 or dist.get_backend(self.group) == "gloo":
            return _OwnSlice(self.inner.allreduce(tensor), tensor, start, stop)
        return _OwnSlice(self.inner.reduce_scatter(self._padded(tensor)), tensor, start, stop)

    def gather_bucket(self, tensor: torch.Tensor) -> Pending:
        """Every rank's copy of this rank's slice of the bucket, ``(N, ceil(n / N))`` (an all-to-all)."""
        return self.inner.all_to_all(self._padded(tensor))

    def bucket_parts(self, numel: int) -> tuple[tuple[int, int], ...]:
        """Every rank's slice of a bucket of ``numel`` elements, in rank order: what ``gather_bucket`` sends where."""
        size = math.ceil(numel / self.world_size)
        return tuple((rank * size, (rank + 1) * size) for rank in range(self.world_size))

    def kept_range(self, numel: int) -> tuple[int, int]:
        """This rank's slice of a bucket of ``numel`` elements, in its zero-padded layout."""
        return self.bucket_parts(numel)[self.rank]

    @property
    def whole(self) -> Comm:
        """The comm this one scatters over, whose bucket collectives leave every rank the whole bucket."""
        return self.inner

    def allreduce(self, tensor: torch.Tensor) -> Pending:
        return self.inner.allreduce(tensor)

    def allgather(self, tensor: torch.Tensor) -> Pending:
        return self.inner.allgather(tensor)

    def take_counters(self) -> tuple[int, int]:
        return self.inner.take_counters()
