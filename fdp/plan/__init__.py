"""Static gradient-bucket plans, decided before step 1 and kept as plain values.

PyTorch DDP picks its buckets at run time: a first guess in reverse ``parameters()``
order, rebuilt after the first iteration from the order it observed. fdp instead traces
one backward before training, records the order in which each gradient becomes ready, and
packs that order into buckets once. The result, a :class:`BucketPlan`, is an immutable
value: print it, save it as JSON, and compare its :meth:`~BucketPlan.fingerprint` across
ranks before the first all-reduce.

>>> plan = pack_into_buckets([("fc2.bias", (10,), "float32", "cpu"),
...                           ("fc2.weight", (10, 64), "float32", "cpu"),
...                           ("fc1.weight", (64, 32), "float32", "cpu")],
...                          bucket_cap_mb=0.01, first_bucket_cap_mb=0.001)
>>> [b.names for b in plan.buckets]
[('fc2.bias',), ('fc2.weight',), ('fc1.weight',)]
"""

from fdp.plan.fragments import fragment_plan, split_fragments
from fdp.plan.packing import pack_into_buckets
from fdp.plan.tracing import Trace, gradient_ready_order, plan_buckets
from fdp.plan.values import Bucket, BucketPlan, ParamSlot, TensorSpec

__all__ = [
    "ParamSlot",
    "Bucket",
    "BucketPlan",
    "TensorSpec",
    "Trace",
    "gradient_ready_order",
    "plan_buckets",
    "pack_into_buckets",
    "split_fragments",
    "fragment_plan",
]
