"""What a step learns of each bucket's reduced gradient: its norm and whether it is finite.

Kept on the device, one small tensor per bucket (or slice), and combined once per step:
the gradient norm it reports (``global_norm``) and the finite check of
``trainer.nonfinite`` never make the host wait bucket by bucket.
"""

from __future__ import annotations

import torch

from fdp.plan import BucketPlan

__all__ = ["bucket_norm", "describe_bucket", "finite_flag", "global_norm"]


def bucket_norm(flat: torch.Tensor) -> torch.Tensor:
    """The L2 norm of a bucket's (or slice's) gradient, in float32 whatever its dtype, kept on the device.

    >>> bucket_norm(torch.tensor([3.0, 4.0], dtype=torch.bfloat16)).item()
    5.0
    """
    return torch.linalg.vector_norm(flat, dtype=torch.float32)


def global_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The norm of the concatenated tensors whose norms are ``norms`` (on the first one's device).

    >>> global_norm([torch.tensor(3.0), torch.tensor(4.0)]).item()
    5.0
    """
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def finite_flag(flat: torch.Tensor) -> torch.Tensor:
    """One flag per bucket, kept on the device: a NaN or inf anywhere makes the sum non-finite.

    >>> finite_flag(torch.tensor([1.0, float("nan")])).item()
    False
    """
    return torch.isfinite(flat.sum(dtype=torch.float32))


def describe_bucket(plan: BucketPlan, index: int) -> str:
    """How an error names a bucket: its index and its first parameters.

    >>> from fdp.plan import pack_into_buckets
    >>> describe_bucket(pack_into_buckets([("w", (2,), "float32", "cpu")]), 0)
    'bucket 0 (w)'
    """
    names = plan.buckets[index].names
    return f"bucket {index} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
