"""A train state as logical tensors that the ranks hold pieces of: what a sharded checkpoint stores.

Every parameter, and every optimizer-state leaf that belongs to one parameter, is one
logical tensor: the parameter flattened to 1-D, named by its path in the state
(``params['fc.weight']``, ``opt_state[1].mu['fc.weight']``), whatever the stage that holds
it. A ZeRO slice of a bucket (``opt_state[1].mu['bucket0']``) is cut at the parameters'
boundaries into pieces of those logical tensors, each with its offset; a whole tensor
held by every rank is written in ``world`` near-equal pieces, one by each rank. A leaf that
belongs to no parameter (an optimizer's step count, the loss scale) is one logical tensor
whole on every rank (``torch.distributed.checkpoint`` writes it once).

The pieces are plain tensors that carry DCP's ``CheckpointableTensor`` fields
(``global_shape``, ``global_offsets``, ``local_offsets``, ``local_sizes``), so DCP's default
planners write them as chunks of the logical tensor and, reading, fetch any range from
the chunks that overlap it: a checkpoint written by one layout is read by any other.
A flat 1-D logical tensor is what lets a bucket's slice, which crosses parameter
boundaries and splits a parameter anywhere, be one chunk per parameter: a parameter's
own shape would cut it into rows.

>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([("w", (3, 2), "float32", "cpu")])
>>> tensors, plain = state_pieces({"params": {"w": torch.arange(6.0).view(3, 2)}}, plan, rank=1, world=2)
>>> piece = tensors["params['w']"]
>>> piece.tolist(), piece.global_shape, piece.global_offsets
([3.0, 4.0, 5.0], (6,), ((3,),))
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import torch

from fdp._torch import mark_chunk, tree_flatten, tree_paths
from fdp.plan import BucketPlan

__all__ = ["state_pieces", "rank_pieces", "logical_key", "param_shapes", "SliceRange"]

SliceRange = Callable[[int], tuple[int, int]]  # bucket index -> this rank's (start, stop) in its padded flat layout

_SLICE = re.compile(r"\['bucket(\d+)'\]$")


def logical_key(path: str, plan_names: set[str]) -> tuple[str | None, str]:
    """``(param name or None, the path with a bucket's key left as is)``: the parameter a leaf's path ends on.

    >>> logical_key("opt_state[1].mu['fc.weight']", {"fc.weight"})
    ('fc.weight', "opt_state[1].mu['fc.weight']")
    """
    return _param_of(path, _suffixes(plan_names)), path


def _suffixes(plan_names: set[str]) -> dict[str, str]:
    """Each parameter by the key that ends the path of a leaf of it (``['fc.weight']``)."""
    return {f"[{name!r}]": name for name in plan_names}


def _param_of(path: str, suffixes: dict[str, str]) -> str | None:
    # A dict lookup per bracket from the right, not a scan of every name per leaf (a save's hot path).
    start = path.rfind("[")
    while start >= 0:
        if path[start:] in suffixes:
            return suffixes[path[start:]]
        start = path.rfind("[", 0, start)
    return None


def param_shapes(plan: BucketPlan) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, by name: how a logical tensor's 1-D values are given their shape back."""
    return {slot.name: tuple(slot.shape) for bucket in plan.buckets for slot in bucket.slots}


def _piece(flat: torch.Tensor, numel: int, offset: int) -> torch.Tensor:
    """``flat`` (1-D) marked as elements ``[offset, offset + len)`` of a logical 1-D tensor of ``numel``."""
    # an object of its own: the fields are set on it, not on the state's tensor
    return mark_chunk(flat.view(-1)[:], (numel,), (offset,))


def _even_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    size = math.ceil(numel / world)
    return min(rank * size, numel), min((rank + 1) * size, numel)


def state_pieces(
    tree: dict[str, Any],
    plan: BucketPlan,
    rank: int,
    world: int,
    slice_range: SliceRange | None = None,
    reading: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, plain)``: the pieces of logical tensors in ``tree`` (``{"params": ..., "opt_state": ...}``)
    that this rank writes (or, ``reading``, reads into), keyed by logical name; and the leaves that are not tensors.

    ``slice_range`` gives this rank's slice of each bucket where ``tree`` holds slices keyed
    ``bucket<i>`` (ZeRO stages 1-3). Writing, a whole per-parameter tensor is cut into
    ``world`` pieces, this rank's written; reading, a rank reads it whole. The pieces are
    views of ``tree``'s tensors: loading into them fills the state in place.
    """
    slots = {slot.name: slot for bucket in plan.buckets for slot in bucket.slots}
    suffixes = _suffixes(set(slots))
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, Any] = {}
    for prefix, value in tree.items():
        leaves, _ = tree_flatten(value)
        for path, leaf in zip(tree_paths(value), leaves):
            key = prefix + path
            if not isinstance(leaf, torch.Tensor):
                plain[key] = leaf
                continue
            found = _SLICE.search(path)
            if found is not None and slice_range is not None:
                bucket = plan.buckets[int(found.group(1))]
                start, stop = slice_range(bucket.index)
                flat = leaf.view(-1)
                for slot in bucket.slots:  # the part of each parameter that falls in this slice
                    lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
                    if lo < hi:
                        tensors[prefix + path[: found.start()] + f"[{slot.name!r}]"] = _piece(
                            flat[lo - start : hi - start], slot.numel, lo - slot.offset
                        )
                continue
            name = _param_of(path, suffixes)
            if name is not None and leaf.numel() == slots[name].numel:
                lo, hi = (0, leaf.numel()) if reading else _even_range(leaf.numel(), rank, world)
                if lo < hi:
                    # Read into a view (a copy would not fill the state); written from a copy where need be.
                    flat = leaf.view(-1) if reading else leaf.reshape(-1)
                    tensors[key] = _piece(flat[lo:hi], leaf.numel(), lo)
                continue
            tensors[key] = leaf  # a leaf of no parameter: whole everywhere
    return tensors, plain


def rank_pieces(
    tree: dict[str, Any], plan: BucketPlan, rank: int, reading: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``state_pieces`` of what rank ``rank`` alone holds (an outer loop's own params between syncs): whole
    logical tensors keyed ``rank<r>/...``, that rank's to write; and the leaves that are not tensors, unprefixed.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2,), "float32", "cpu")])
    >>> tensors, _ = rank_pieces({"params": {"w": torch.ones(2)}}, plan, rank=3)
    >>> list(tensors), tensors["rank3/params['w']"].global_shape
    (["rank3/params['w']"], (2,))
    """
    tensors, plain = state_pieces(tree, plan, 0, 1, reading=reading)
    return {f"rank{rank}/{key}": t for key, t in tensors.items()}, plain
