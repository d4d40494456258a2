"""Half-precision compression: cast before the collective, cast back after.

``fp16_compress()`` and ``bf16_compress()`` replace the bucket's buffer by a 16-bit copy;
``fp16_decompress()`` / ``bf16_decompress()`` cast whatever arrives back to the bucket's
own dtype (``grads.spec.torch_dtype``). Between them any hook may run, so
``chain(fp16_compress(), powersgd(), fp16_decompress())`` is DDP's
``fp16_compress_wrapper(powerSGD_hook)``.

``fp16()`` and ``bf16()`` are the usual chains with a plain average in the middle. Their
numerics are those of DDP's ``fp16_compress_hook``: the gradient is cast first and then
divided by the world size *in 16 bits*, summed in 16 bits, and only then cast back (the
``allreduce`` hook divides before summing, which is what keeps the sum in range).

DDP refuses ``bf16_compress_hook`` unless NCCL is available (it checks the hook's name),
but gloo sums bfloat16 tensors correctly, so ``bf16()`` works on CPU worlds too.

>>> from fdp.hooks import run_hook
>>> hook = fp16()
"""

from __future__ import annotations

from typing import Any

import torch

from fdp.hooks.allreduce import allreduce
from fdp.hooks.base import GradBucket, Hook, chain, drive_hook, hook_name, stateless

__all__ = ["fp16_compress", "fp16_decompress", "bf16_compress", "bf16_decompress", "fp16", "bf16", "reduced_in"]


def _cast(grads: GradBucket, dtype: torch.dtype) -> GradBucket:
    # ``to`` returns a new tensor (which the chain then owns) whenever the dtype changes;
    # when it does not, the buffer is passed on as it came.
    buffer = grads.buffer.to(dtype)
    return grads._replace(buffer=buffer, owned=grads.owned or buffer is not grads.buffer)


def _cast_to(dtype: torch.dtype, name: str) -> Hook:
    def cast(grads: GradBucket, comm) -> GradBucket:
        return _cast(grads, dtype)

    cast.__qualname__ = name  # errors name the hook as the user wrote it
    return stateless(cast, shardable=True)


def _cast_back(name: str) -> Hook:
    def cast_back(grads: GradBucket, comm) -> GradBucket:
        return _cast(grads, grads.spec.torch_dtype)

    cast_back.__qualname__ = name
    return stateless(cast_back, shardable=True)


def fp16_compress() -> Hook:
    """Cast the bucket to ``float16`` (no division: the next hook averages)."""
    return _cast_to(torch.float16, "fp16_compress")


def bf16_compress() -> Hook:
    """Cast the bucket to ``bfloat16`` (no division: the next hook averages)."""
    return _cast_to(torch.bfloat16, "bf16_compress")


def fp16_decompress() -> Hook:
    """Cast the bucket back to its own dtype (``grads.spec.torch_dtype``)."""
    return _cast_back("fp16_decompress")


def bf16_decompress() -> Hook:
    """Cast the bucket back to its own dtype (``grads.spec.torch_dtype``)."""
    return _cast_back("bf16_decompress")


def fp16() -> Hook:
    """``chain(fp16_compress(), allreduce(), fp16_decompress())``: DDP's ``fp16_compress_hook``."""
    return chain(fp16_compress(), allreduce(), fp16_decompress(), name="fp16")


def bf16() -> Hook:
    """``chain(bf16_compress(), allreduce(), bf16_decompress())``: DDP's ``bf16_compress_hook``, on gloo too."""
    return chain(bf16_compress(), allreduce(), bf16_decompress(), name="bf16")


def reduced_in(dtype: torch.dtype, hook: Hook) -> Hook:
    """``hook`` run on the bucket cast to ``dtype``, its result cast back to the bucket's own dtype.

    FSDP2's ``MixedPrecisionPolicy.reduce_dtype``: ``reduced_in(torch.bfloat16, allreduce())``
    averages as ``bf16()`` does. Unlike ``chain(bf16_compress(), hook, bf16_decompress())`` its
    state is ``hook``'s own, so a train state made for ``hook`` (and its checkpoints) fits it.

    >>> from fdp.hooks import allreduce, run_hook
    >>> hook = reduced_in(torch.bfloat16, allreduce())
    >>> hook.init(None), hook.shardable
    ((), True)
    """

    def apply(state: Any, grads: GradBucket, comm):
        out, state = yield from drive_hook(hook.apply(state, _cast(grads, dtype), comm))
        return _cast(out, grads.spec.torch_dtype), state

    apply.__qualname__ = f"reduced_in.{hook_name(hook)}"
    return Hook(hook.init, apply, hook.shardable)
