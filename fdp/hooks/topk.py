"""Top-k sparsification with error feedback.

Each rank sends only the k entries of (gradient + error) largest in magnitude, as values
and positions (two allgathers), and every rank adds all ranks' entries into the same
dense average, or where ZeRO stages 2 and 3 keep slices (``comm.kept_range``) the
entries that fall into its slice into that slice alone. What a rank did not send stays
in its error and is added the next step, so over many steps every part of the gradient
gets through.

>>> hook = topk(ratio=0.01)
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from fdp.comm import Comm
from fdp.errors import check_bool, check_real, require
from fdp.hooks.base import GradBucket, Hook, expect_floating
from fdp.plan import Bucket

__all__ = ["TopKState", "topk"]


class TopKState(NamedTuple):
    """One bucket's top-k state: this rank's unsent residual (``None`` without error feedback)."""

    error: torch.Tensor | None


def topk(ratio: float = 0.01, error_feedback: bool = True, k: int | None = None) -> Hook:
    """Send the ``k`` largest-magnitude entries of each bucket; average the sparse sums densely.

    ``k`` is ``ceil(ratio * numel)`` per bucket (at least 1) unless given explicitly
    (capped at the bucket's size). ``ratio=1.0`` sends everything and gives exactly what
    ``allreduce()`` gives. Each rank sends ``k`` values plus ``k`` int32 positions (int64 for
    buckets of 2**31 elements or more), so it pays off below ``ratio`` of about 0.5.

    With ``error_feedback`` the entries not sent are kept (``TopKState.error``) and added
    to the next step's gradient; without it they are dropped.
    """
    ratio = check_real("ratio", ratio, 0.0, 1.0, low_open=True, what="a fraction with 0 < ratio <= 1")
    error_feedback = check_bool("error_feedback", error_feedback)
    if k is not None:
        require(
            isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 1,
            "k",
            k,
            "an integer >= 1 (or unset, to use ratio)",
        )

    def count(numel: int) -> int:
        wanted = k if k is not None else math.ceil(ratio * numel)
        return max(1, min(int(wanted), numel))

    def init(bucket: Bucket) -> TopKState:
        if not error_feedback:
            return TopKState(None)
        return TopKState(torch.zeros(bucket.numel, dtype=bucket.torch_dtype, device=bucket.device))

    def apply(state: TopKState, grads: GradBucket, comm: Comm):
        expect_floating(grads, "topk")
        world = comm.world_size
        buf = grads.buffer
        x = buf + state.error.to(buf.dtype) if error_feedback else buf
        numel = x.numel()
        _, where = torch.topk(x.abs(), count(numel), sorted=False)
        sent = x[where]  # a new tensor (advanced indexing copies)
        index_dtype = torch.int32 if numel < 2**31 else torch.int64
        values_pending = comm.allgather(sent)
        where_pending = comm.allgather(where.to(index_dtype))
        values = yield values_pending
        positions = yield where_pending
        # Divide each contribution before adding, in rank order, as allreduce() divides
        # before summing: with ratio=1 the result is the same to the bit.
        positions, contributions = positions.reshape(-1).long(), (values / world).reshape(-1)
        start, stop = comm.kept_range(numel)
        if (start, stop) != (0, numel):  # the entries in this rank's slice, in the same order
            inside = (positions >= start) & (positions < stop)
            positions, contributions = positions[inside] - start, contributions[inside]
        dense = x.new_zeros(stop - start).index_add(0, positions, contributions)
        error = x.index_fill(0, where, 0).to(state.error.dtype) if error_feedback else None
        return grads._replace(buffer=dense), TopKState(error)

    return Hook(init, apply, shardable=True)
