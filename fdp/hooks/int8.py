"""Int8 quantisation with one scale per bucket shared by all ranks, and error feedback.

``int8()`` is the chain of three hooks; the scale goes from the first to the last in
the bucket's ``side`` data, the rounding error stays in the first one's state:

* ``int8_compress()``: ``x = gradient + error``. The ranks agree on one scale for the
  bucket, ``s = max |x| / 127`` with the maximum over all ranks (an allgather of one
  number per rank), and round ``x / s`` to int8. What rounding lost, ``x - q s``, is this
  rank's new error, added to the next step's gradient (``Int8State.error``).
* ``int8_sum()``: every rank's int8 bucket, summed in int32. An allgather sends one byte
  per element (a quarter of float32's four); a sum of int8 values in int8, as an
  allreduce would compute it, overflows from two ranks on.
* ``int8_decompress()``: ``sum * s / world`` in the bucket's own dtype.

With one shared scale the sum of the ranks' integers is exact, so the average is off by
at most half a step ``s / 2`` per entry, and error feedback carries that into the next
step instead of dropping it.

>>> from fdp.hooks import run_hook
>>> hook = int8()
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fdp.comm import Comm
from fdp.errors import check_bool
from fdp.hooks.base import GradBucket, Hook, chain, expect_floating, stateless
from fdp.plan import Bucket

__all__ = ["Int8State", "int8", "int8_compress", "int8_sum", "int8_decompress", "SCALE"]

SCALE = "int8_scale"  # the key of the scale in GradBucket.side
_LEVELS = 127  # symmetric: -127..127, so that -q is representable for every q


class Int8State(NamedTuple):
    """One bucket's int8 state: this rank's rounding residual (``None`` without error feedback)."""

    error: torch.Tensor | None


def int8_compress(error_feedback: bool = True) -> Hook:
    """Round the bucket (plus last step's error) to int8 with a scale shared by all ranks.

    The int8 buffer goes on to ``int8_sum()``; the scale, a 0-d tensor, goes on in
    ``grads.side["int8_scale"]`` for ``int8_decompress()``.

    >>> hook = int8_compress(error_feedback=False)
    """
    error_feedback = check_bool("error_feedback", error_feedback)

    def init(bucket: Bucket) -> Int8State:
        if not error_feedback:
            return Int8State(None)
        return Int8State(torch.zeros(bucket.numel, dtype=bucket.torch_dtype, device=bucket.device))

    def compensated(grads: GradBucket, state: Int8State) -> torch.Tensor:
        buf = grads.buffer
        return buf + state.error.to(buf.dtype) if error_feedback else buf

    def apply(state: Int8State, grads: GradBucket, comm: Comm):
        expect_floating(grads, "int8_compress")
        local_max = compensated(grads, state).abs().max().reshape(1)
        maxima = yield comm.allgather(local_max)
        # Made after the first collective: under the overlap schedule the code before it
        # may run inside torch.func's transform, whose tensors must not reach the state.
        x = compensated(grads, state)
        top = maxima.max()
        scale = torch.where(top > 0, top / _LEVELS, torch.ones_like(top))  # an all-zero bucket stays zero
        q = torch.round(x / scale).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
        new_state = Int8State((x - q.to(x.dtype) * scale).to(state.error.dtype)) if error_feedback else state
        return grads._replace(buffer=q, owned=True, side={**grads.side, SCALE: scale}), new_state

    apply.__qualname__ = "int8_compress"
    return Hook(init, apply, shardable=True)


def int8_sum() -> Hook:
    """Sum the ranks' int8 buckets in int32 (an allgather of the int8 values, then a local sum).

    >>> hook = int8_sum()
    """

    def int8_sum(grads: GradBucket, comm: Comm):
        if grads.buffer.dtype != torch.int8:
            raise TypeError(
                f"hook int8_sum got bucket {grads.index} as {grads.buffer.dtype}: expected int8 "
                "(put int8_compress() before it)"
            )
        gathered = yield comm.gather_bucket(grads.buffer)
        return grads._replace(buffer=gathered.sum(0, dtype=torch.int32), owned=True)

    return stateless(int8_sum, shardable=True)


def int8_decompress() -> Hook:
    """``sum * scale / world`` in the bucket's dtype, with the scale ``int8_compress()`` left in ``side``.

    >>> hook = int8_decompress()
    """

    def int8_decompress(grads: GradBucket, comm: Comm) -> GradBucket:
        if SCALE not in grads.side:
            raise TypeError(
                f"hook int8_decompress got bucket {grads.index} without side[{SCALE!r}]: "
                "put int8_compress() earlier in the same chain"
            )
        dtype = grads.spec.torch_dtype
        scale = grads.side[SCALE].to(dtype)
        out = grads.buffer.to(dtype) * (scale / comm.world_size)
        side = {key: value for key, value in grads.side.items() if key != SCALE}
        return grads._replace(buffer=out, owned=True, side=side)

    return stateless(int8_decompress, shardable=True)


def int8(error_feedback: bool = True) -> Hook:
    """``chain(int8_compress(error_feedback), int8_sum(), int8_decompress())``.

    >>> hook = int8()
    """
    return chain(int8_compress(error_feedback), int8_sum(), int8_decompress(), name="int8")
