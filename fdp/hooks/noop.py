"""No reduction at all: what a step costs without communication.

>>> from fdp.hooks import run_hook
>>> hook = noop()
"""

from __future__ import annotations

from fdp.comm import Comm
from fdp.hooks.base import GradBucket, Hook, stateless

__all__ = ["noop"]


def noop() -> Hook:
    """Return each rank's own gradient, unchanged and undivided, like DDP's ``noop_hook``.

    Ranks drift apart under it: use it to measure the cost of communication (step time
    with ``allreduce()`` minus step time with ``noop()``), not to train.
    """

    def apply(grads: GradBucket, comm: Comm) -> GradBucket:
        return grads

    return stateless(apply, shardable=True)
