"""Weight decay by parameter name on ZeRO's flat slices: each slice's runs of decayed elements, from the plan.

An optimizer with a ``decay_mask`` (``optim.decay_filter``) decides by a parameter's name
and value whether it decays; a ZeRO rank steps ``{"bucket<i>": slice}`` instead, and a
slice may start and end inside parameters. The plan says statically which parameter
every element of a bucket's flat layout belongs to, so before step 1 each slice's answer
is worked out once: ``True`` (every element decays), ``False`` (none), or the
``(start, stop)`` runs of elements that do (``fdp.optim.transforms.DecayRuns``). The
optimizer then steps the runs as torch's two param groups would step those elements: no
mask tensor, no per-step cost beyond views of the runs (``GradientTransformation.with_decay_mask``).

>>> import torch
>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([("w", (2, 2), "float32", "cpu"), ("b", (2,), "float32", "cpu")])
>>> rule = lambda name, param: param.ndim >= 2  # decay_filter=weights, no embeddings
>>> slice_decay(plan, rule, rank=0, world=2), slice_decay(plan, rule, rank=1, world=2)
({'bucket0': True}, {'bucket0': ((0, 1),)})
"""

from __future__ import annotations

import torch

from fdp.optim import GradientTransformation
from fdp.optim.transforms import DecayMask, DecayRuns
from fdp.plan import BucketPlan
from fdp.update.zero.layout import slice_key, slice_range

__all__ = ["slice_decay", "sliced_optimizer"]


def slice_decay(plan: BucketPlan, rule: DecayMask, rank: int, world: int) -> dict[str, bool | DecayRuns]:
    """Each of rank ``rank``'s slices (of ``world``) keyed ``bucket<i>``: whether, or in which runs, it decays by
    ``rule`` (asked once per parameter, with a ``meta`` tensor of its shape). Padding past a bucket's end
    counts as decayed: it is zero, and stays so."""
    decays: dict[str, bool] = {}
    answers: dict[str, bool | DecayRuns] = {}
    for bucket in plan.buckets:
        start, stop = slice_range(bucket, rank, world)
        runs: list[tuple[int, int]] = []
        for slot in bucket.slots:
            low, high = max(start, slot.offset), min(stop, slot.stop)
            if low >= high:
                continue
            if slot.name not in decays:
                decays[slot.name] = bool(rule(slot.name, torch.empty(slot.shape, device="meta")))
            if not decays[slot.name]:
                continue
            if runs and runs[-1][1] == low - start:  # adjacent params that both decay: one run
                runs[-1] = (runs[-1][0], high - start)
            else:
                runs.append((low - start, high - start))
        real = max(0, min(stop, bucket.numel) - start)  # the slice's elements before the padding
        whole = real > 0 and runs == [(0, real)]
        answers[slice_key(bucket.index)] = True if whole else tuple(runs) if runs else False
    return answers


def sliced_optimizer(
    optimizer: GradientTransformation, plan: BucketPlan, rank: int, world: int
) -> GradientTransformation:
    """``optimizer`` as it steps rank ``rank``'s slices: a rule by name (``by_name``) becomes the slices' runs;
    any other optimizer is itself. (One without ``with_decay_mask`` is refused first: ``Stage.refuses_optimizer``.)"""
    if not optimizer.by_name or optimizer.with_decay_mask is None:
        return optimizer

    def to_slices(rule: DecayMask) -> DecayMask:
        answers = slice_decay(plan, rule, rank, world)
        return lambda key, param: answers[key]

    return optimizer.with_decay_mask(to_slices)
