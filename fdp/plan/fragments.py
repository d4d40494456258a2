"""Fragments of a plan: contiguous runs of buckets, balanced by size, that sync on their own.

Streaming DiLoCo (Douillard et al. 2025) syncs a model fragment by fragment, each on its
own step, so that a sync moves a fraction of the model. Buckets are already the plan's
unit of communication, laid out in gradient-ready order (the model's blocks from the last
to the first), so a fragment is a run of whole buckets: ``split_fragments`` cuts the
plan so that its largest fragment is as small as can be.

>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([(f"w{i}", (n,), "float32", "cpu") for i, n in enumerate([4, 4, 4, 12])],
...                          bucket_cap_mb=16 / 2**20, first_bucket_cap_mb=16 / 2**20)
>>> split_fragments(plan, 2)
(range(0, 3), range(3, 4))
"""

from __future__ import annotations

import dataclasses

from fdp.plan.values import BucketPlan

__all__ = ["split_fragments", "fragment_plan"]


def split_fragments(plan: BucketPlan, count: int) -> tuple[range, ...]:
    """``count`` contiguous runs of ``plan``'s buckets, each near ``1/count`` of its entries.

    A ``ValueError`` when the plan has fewer buckets than ``count`` (smaller buckets make more).

    >>> from fdp.plan import pack_into_buckets
    >>> split_fragments(pack_into_buckets([("w", (3,), "float32", "cpu")]), 1)
    (range(0, 1),)
    """
    buckets = len(plan.buckets)
    if not 1 <= count <= buckets:
        raise ValueError(
            f"outer.fragments={count!r}: expected an integer in [1, {buckets}] (the plan's buckets; "
            "a smaller trainer.bucket_cap_mb makes more)"
        )
    sizes = [bucket.numel for bucket in plan.buckets]
    # best[k][i]: the smallest largest fragment splitting the first i buckets into k runs,
    # and where its last run starts (buckets and fragments are few: a plain table).
    ends = [0]
    for size in sizes:
        ends.append(ends[-1] + size)
    best = [[(float("inf"), 0)] * (buckets + 1) for _ in range(count + 1)]
    best[0][0] = (0, 0)
    for k in range(1, count + 1):
        for i in range(k, buckets + 1):
            best[k][i] = min((max(best[k - 1][j][0], ends[i] - ends[j]), j) for j in range(k - 1, i))
    cuts, i = [buckets], buckets
    for k in range(count, 0, -1):
        i = best[k][i][1]
        cuts.append(i)
    cuts.reverse()
    return tuple(range(a, b) for a, b in zip(cuts, cuts[1:]))


def fragment_plan(plan: BucketPlan, buckets: range) -> BucketPlan:
    """The plan of one fragment: its buckets, numbered from 0.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("a", (2,), "float32", "cpu"), ("b", (2,), "float32", "cpu")], 8 / 2**20, 8 / 2**20)
    >>> fragment_plan(plan, range(1, 2)).names
    ('b',)
    """
    parts = [dataclasses.replace(plan.buckets[i], index=n) for n, i in enumerate(buckets)]
    return BucketPlan(parts, plan.bucket_cap_mb, plan.first_bucket_cap_mb)
