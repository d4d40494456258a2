"""A reduction hook of your own: clip each rank's gradient of a bucket, then average over ranks.

``hooks=custom hooks._target_=my_project.hooks.clip_then_allreduce +hooks.max_norm=1.0``
calls the factory with ``max_norm=1.0``; what it returns is an ``fdp.hooks.Hook`` (here a
chain of a stage of its own and fdp's ``allreduce``). The stage keeps, per bucket, how many
steps it saw and how many it clipped: that state is part of the train state, so it is
checkpointed and resumed with the rest. The clip works on this rank's whole bucket before
the sum, so the chain is ``shardable`` (ZeRO stages 2 and 3 reduce-scatter the sum).

>>> from fdp.hooks import GradBucket, run_hook
>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([("w", (2,), "float32", "cpu")])
>>> hook = clip_then_allreduce(max_norm=1.0)
>>> state = hook.init(plan.buckets[0])
>>> grads, state = run_hook(hook, state, GradBucket(0, torch.tensor([3.0, 4.0]), plan.buckets[0]), fdp.Comm())
>>> grads.buffer, int(state[0].clipped)
(tensor([0.6000, 0.8000]), 1)
"""

from typing import NamedTuple

import torch

import fdp
from fdp.hooks import GradBucket, Hook, allreduce, chain


class ClipCounts(NamedTuple):
    """Per bucket: the steps seen and how many of them were clipped (tensors, so checkpoints keep them)."""

    steps: torch.Tensor
    clipped: torch.Tensor


def clip_then_allreduce(max_norm: float = 1.0) -> Hook:
    """Scale this rank's bucket gradient to L2 norm ``max_norm`` where it is longer, then average over ranks."""
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r}: expected a number > 0")

    def init(bucket) -> ClipCounts:
        zero = torch.zeros((), dtype=torch.int64, device=bucket.device)
        return ClipCounts(zero, zero.clone())

    def apply(state: ClipCounts, grads: GradBucket, comm: fdp.Comm):
        norm = torch.linalg.vector_norm(grads.buffer, dtype=torch.float32)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        buffer = grads.buffer * scale.to(grads.buffer.dtype)
        return grads._replace(buffer=buffer, owned=True), ClipCounts(state.steps + 1, state.clipped + (scale < 1))

    return chain(Hook(init, apply, shardable=True), allreduce())
