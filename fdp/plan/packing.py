"""Packing a gradient-ready order into buckets: the pure rule behind every plan."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from fdp.plan.values import Bucket, BucketPlan, MiB, ParamSlot, TensorSpec, _spec, check_cap


def pack_into_buckets(
    order: Sequence[TensorSpec],
    bucket_cap_mb: float = 25.0,
    first_bucket_cap_mb: float = 1.0,
    unused: Sequence[TensorSpec] = (),
) -> BucketPlan:
    """Pack ``(name, shape, dtype, device)`` specs, in gradient-ready order, into buckets.

    Rules (the pure step of :func:`plan_buckets`, usable without a model):

    * tensors are grouped by ``(dtype, device)``, with one open bucket per group;
    * before adding a tensor that would push the open bucket over its cap, that bucket is
      closed; the first bucket of each group is capped at ``first_bucket_cap_mb`` (so the
      first all-reduce starts early), later ones at ``bucket_cap_mb``;
    * a tensor is never split: one larger than the cap gets a bucket of its own;
    * buckets are numbered by the gradient-ready position of their last tensor, i.e. in
      the order they become fully ready in backward;
    * ``unused`` specs (parameters that get no gradient) go into final buckets marked
      ``unused=True``, grouped the same way and capped at ``bucket_cap_mb``.

    >>> f32 = lambda name, n: (name, (n,), "float32", "cpu")
    >>> plan = pack_into_buckets([f32("a", 2), f32("b", 2), f32("c", 3)],
    ...                          bucket_cap_mb=12 / MiB, first_bucket_cap_mb=16 / MiB)
    >>> [b.names for b in plan.buckets]
    [('a', 'b'), ('c',)]
    """
    bucket_cap_mb = check_cap("bucket_cap_mb", bucket_cap_mb)
    first_bucket_cap_mb = check_cap("first_bucket_cap_mb", first_bucket_cap_mb)
    used = [_spec(s) for s in order]
    idle = [_spec(s) for s in unused]
    if not used and not idle:
        raise ValueError("no parameters to plan: the parameter tree is empty")
    seen: set[str] = set()
    for name, *_ in used + idle:
        if name in seen:
            raise ValueError(f"parameter {name!r} appears more than once")
        seen.add(name)
    groups = _greedy(used, first_bucket_cap_mb * MiB, bucket_cap_mb * MiB, unused=False)
    groups += _greedy(idle, bucket_cap_mb * MiB, bucket_cap_mb * MiB, unused=True)
    # Sorting by (unused, position of the last tensor) numbers buckets in the order they
    # become fully ready; unused buckets are never "ready", so they come last.
    buckets = []
    for index, (_, dtype, device, specs, is_unused) in enumerate(sorted(groups, key=lambda g: (g[4], g[0]))):
        slots, offset = [], 0
        for name, shape, _, _ in specs:
            numel = math.prod(shape)
            slots.append(ParamSlot(name, shape, offset, numel))
            offset += numel
        buckets.append(Bucket(index, dtype, device, tuple(slots), offset, is_unused))
    return BucketPlan(tuple(buckets), bucket_cap_mb, first_bucket_cap_mb)


def _greedy(
    specs: list[tuple[str, tuple[int, ...], str, str]], first_cap: float, cap: float, unused: bool
) -> list[tuple[int, str, str, list, bool]]:
    open_: dict[tuple[str, str], list] = {}  # (dtype, device) -> [specs, nbytes, cap, last position]
    closed: list[tuple[int, str, str, list, bool]] = []
    for pos, spec in enumerate(specs):
        _, shape, dtype, device = spec
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        key = (dtype, device)
        cur = open_.get(key)
        if cur is None:
            cur = open_[key] = [[], 0, first_cap, pos]
        elif cur[0] and cur[1] + nbytes > cur[2]:
            # Close before overflowing; an empty bucket still takes an oversized tensor,
            # since tensors are never split.
            closed.append((cur[3], dtype, device, cur[0], unused))
            cur = open_[key] = [[], 0, cap, pos]
        cur[0].append(spec)
        cur[1] += nbytes
        cur[3] = pos
    closed += [(c[3], dtype, device, c[0], unused) for (dtype, device), c in open_.items()]
    return closed
