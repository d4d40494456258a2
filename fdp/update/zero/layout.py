"""How a bucket's flat layout is split over the ranks: each owns an equal slice, to the element.

With ``N`` ranks a bucket of ``n`` elements is padded to ``N * ceil(n / N)`` and rank ``r``
owns elements ``[r * L, (r + 1) * L)``, ``L = ceil(n / N)``, so a slice boundary may fall
inside a parameter and the last slices may hold padding (zeros, never read as a
parameter). A slice is keyed ``bucket<i>`` wherever the state holds it by bucket.

>>> from fdp.plan import pack_into_buckets
>>> bucket = pack_into_buckets([("w", (3, 2), "float32", "cpu")]).buckets[0]
>>> slice_range(bucket, rank=1, world=4)  # 6 elements over 4 ranks: 2 each, the last one padding
(2, 4)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fdp._torch import storage_alias
from fdp.plan import Bucket, BucketPlan
from fdp.plan.buckets import slot_views

__all__ = [
    "slice_numel",
    "slice_range",
    "slice_key",
    "slice_keys",
    "padded_slice",
    "padded_flat",
    "flats_of",
    "param_views",
    "check_names",
]


def slice_numel(bucket: Bucket, world: int) -> int:
    """Elements of one rank's slice of ``bucket``.

    >>> from fdp.plan import pack_into_buckets
    >>> slice_numel(pack_into_buckets([("w", (5,), "float32", "cpu")]).buckets[0], 2)
    3
    """
    return math.ceil(bucket.numel / world)


def slice_range(bucket: Bucket, rank: int, world: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s slice in the bucket's padded flat layout.

    >>> from fdp.plan import pack_into_buckets
    >>> [slice_range(pack_into_buckets([("w", (5,), "float32", "cpu")]).buckets[0], r, 2) for r in (0, 1)]
    [(0, 3), (3, 6)]
    """
    size = slice_numel(bucket, world)
    return rank * size, (rank + 1) * size


def slice_key(index: int) -> str:
    """The key of bucket ``index``'s slice, in a sharded optimizer state (and, at stage 3, params).

    >>> slice_key(3)
    'bucket3'
    """
    return f"bucket{index}"


def slice_keys(plan: BucketPlan) -> list[str]:
    """Every bucket's slice key, in plan order."""
    return [slice_key(b.index) for b in plan.buckets]


def padded_slice(flat: torch.Tensor, start: int, stop: int, copy: bool = False) -> torch.Tensor:
    """A rank's slice ``[start, stop)`` of a bucket's flat tensor, zero past its end (the last slices' padding).

    A view where the slice lies inside ``flat`` and ``copy`` is false; otherwise memory of its own.

    >>> padded_slice(torch.arange(1.0, 6.0), 3, 6)
    tensor([4., 5., 0.])
    """
    piece = flat[start:stop]
    if piece.numel() == stop - start:
        return piece.clone() if copy else piece
    return torch.cat([piece, piece.new_zeros(stop - start - piece.numel())])


def padded_flat(bucket: Bucket, world: int, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors of ``values`` as one zero-padded flat tensor (a copy)."""
    flat = torch.zeros(slice_numel(bucket, world) * world, dtype=bucket.torch_dtype, device=bucket.device)
    views = slot_views(bucket, flat[: bucket.numel])
    with torch.no_grad():
        for name, view in views.items():
            view.copy_(values[name])
    return flat


def param_views(plan: BucketPlan, flats: list[torch.Tensor], order: list[str]) -> dict[str, torch.Tensor]:
    """Every parameter as a view of its bucket's flat buffer, keyed in ``order``."""
    views: dict[str, torch.Tensor] = {}
    for bucket, flat in zip(plan.buckets, flats):
        views.update(slot_views(bucket, flat[: bucket.numel], flat.dtype))  # the flats may be narrower (bf16 gathers)
    return {name: views[name] for name in order}


def _laid_out_flat(params: Mapping[str, torch.Tensor], bucket: Bucket, padded: int) -> torch.Tensor | None:
    """The padded flat buffer ``params`` of ``bucket`` are views of, if they are laid out that way."""
    first, slot0 = params[bucket.slots[0].name], bucket.slots[0]
    base = first.storage_offset() - slot0.offset
    storage = first.untyped_storage()
    if base < 0 or storage.nbytes() < (base + padded) * first.element_size() or first.dtype != bucket.torch_dtype:
        return None
    for slot in bucket.slots:
        p = params[slot.name]
        if (
            p.untyped_storage().data_ptr() != storage.data_ptr()
            or p.storage_offset() != base + slot.offset
            or not p.is_contiguous()
            or p.dtype != first.dtype
        ):
            return None
    return storage_alias(first, -slot0.offset, (padded,), (1,))


def flats_of(params: Mapping[str, torch.Tensor], plan: BucketPlan, world: int, copy: bool) -> list[torch.Tensor]:
    """Each bucket's padded flat buffer of ``params``: the one they are views of (``copy=False``,
    when they are laid out so), else a new one."""
    flats = []
    for bucket in plan.buckets:
        padded = slice_numel(bucket, world) * world
        flat = None if copy else _laid_out_flat(params, bucket, padded)
        flats.append(flat if flat is not None else padded_flat(bucket, world, params))
    return flats


def check_names(params: Mapping[str, torch.Tensor], plan: BucketPlan) -> None:
    """Refuse params that name other tensors than ``plan`` does."""
    if set(params) != set(plan.names):
        raise ValueError(
            f"zero: params and bucket plan name different tensors: {sorted(set(params) ^ set(plan.names))[:5]}"
        )
