"""Plain averaging: the reduction every data-parallel step starts from."""
from __future__ import annotations

from fdp.comm import Comm
from fdp.hooks.base import GradBucket, Hook, stateless


def allreduce() -> Hook:
    """Average the bucket over ranks (divide by the world size, then sum), like DDP's ``allreduce_hook``.

    >>> from fdp.hooks import run_hook
    >>> hook = allreduce()
    """

    def apply(grads: GradBucket, comm: Comm):
        # Dividing first keeps the sum in range for low-precision buckets; the division
        # also makes the new tensor that the in-place collective may overwrite.
        summed = yield comm.allreduce(grads.buffer / comm.world_size)
        return grads._replace(buffer=summed)

    return stateless(apply)
