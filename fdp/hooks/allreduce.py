"""Plain averaging: the reduction every data-parallel step starts from."""

from __future__ import annotations

from fdp.comm import Comm
from fdp.hooks.base import GradBucket, Hook, expect_floating, stateless


def allreduce() -> Hook:
    """Average the bucket over ranks (divide by the world size, then sum), like DDP's ``allreduce_hook``.

    >>> from fdp.hooks import run_hook
    >>> hook = allreduce()
    """

    def apply(grads: GradBucket, comm: Comm):
        expect_floating(grads, "allreduce")
        world = comm.world_size
        if world == 1:  # the same path (and the same collective) as many ranks, without the no-op division
            summed = yield comm.sum_bucket(grads.buffer)
            return grads._replace(buffer=summed)
        # Dividing first keeps the sum in range for low-precision buckets. The collective
        # writes into its input, so a buffer the chain does not own is divided into a copy.
        buffer = grads.buffer.div_(world) if grads.owned else grads.buffer / world
        summed = yield comm.sum_bucket(buffer)
        return grads._replace(buffer=summed, owned=True)

    return stateless(apply, shardable=True)
