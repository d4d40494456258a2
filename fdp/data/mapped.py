"""A user's own data: map-style torch Datasets read in the global batch order through a DataLoader."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import IterableDataset, Sampler, default_collate

from fdp._torch import tree_map
from fdp.data.batches import LABELS, _epoch_indices, as_batch, batch_size, check_global_batch, model_inputs


# -- a user's own data: map-style torch Datasets through a DataLoader ----------------------
class MapData(NamedTuple):
    """Train, test and validation splits as map-style ``torch.utils.data.Dataset`` objects, and how their items
    become a batch (``val``: the data's own validation split, or one held out of ``train``: ``fdp.data.splits``).

    Items are ``(input, target)`` pairs or dicts whose ``labels`` entry is the target
    (Hugging Face's convention; the other entries go to the model by name), made of
    tensors, numbers or NumPy arrays; ``test`` may be ``None``. ``collate`` turns a list of
    items into a batch: ``fdp.data.collate`` (stacking) unless the data brings its own,
    such as a Hugging Face data collator that pads. Items are read by index through a
    ``DataLoader`` (``train_batches``), so a split need not fit in memory. A split may
    carry ``num_classes`` (or torchvision's ``classes``), ``vocab_size`` or
    ``block_size`` attributes for the model's constructor (``model_arguments``).

    >>> from torch.utils.data import TensorDataset
    >>> from fdp.data import has_test_split
    >>> data = as_map_data("toy", (TensorDataset(torch.randn(10, 3), torch.arange(10) % 2), None))
    >>> len(data.train), has_test_split(data)
    (10, False)
    """

    name: str
    train: TorchDataset
    test: TorchDataset | None
    collate: Callable[[list], Any] | None = None
    val: TorchDataset | None = None  # the validation split: the data's own, or held out (fdp.data.splits)

    def collate_fn(self) -> Callable[[list], Any]:
        """The function that makes a batch of a list of items (``collate`` unless the data brings its own)."""
        return collate if self.collate is None else _OwnCollate(self.collate)


class _OwnCollate:
    """The data's own collate function, its batch with plain dicts (picklable for DataLoader workers)."""

    def __init__(self, fn: Callable[[list], Any]):
        self.fn = fn

    def __call__(self, items: list) -> Any:
        return as_batch(self.fn(items))


_ITEM_PARTS = (Tensor, int, float, bool, np.ndarray, np.number)


def _check_item(item: Any, which: str) -> None:
    # fdp's own collate stacks pairs or dicts of tensors, numbers and arrays.
    if isinstance(item, Mapping):
        if LABELS not in item:
            raise ValueError(
                f"{which} item 0 is a dict with entries {sorted(item)}; expected a {LABELS!r} entry (the target)"
            )
        parts = item.items()
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        parts = zip(("input", "target"), item)
    else:
        kind = f"a {len(item)}-tuple" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}"
        raise ValueError(f"{which} item 0 is {kind}; expected a pair (input, target) or a dict with a {LABELS!r} entry")
    for part, value in parts:
        leaves = value.values() if isinstance(value, Mapping) else [value]
        for leaf in leaves:
            if not isinstance(leaf, _ITEM_PARTS):
                # Token ids of different lengths are lists: they need a collate function that pads.
                hint = (
                    " (or return (train, test, collate) with a function that pads them,"
                    " such as a Hugging Face data collator)"
                    if isinstance(leaf, (list, tuple))
                    else ""
                )
                raise ValueError(
                    f"{which} item 0: its {part} is a {type(leaf).__name__}; "
                    f"expected a tensor, a number or an array{hint}"
                )


def _check_split(split: Any, which: str, own_collate: Callable | None) -> None:
    if isinstance(split, IterableDataset) or not hasattr(split, "__getitem__"):
        raise ValueError(
            f"the {which} split is a {type(split).__name__}; expected a map-style torch Dataset (items by index)"
        )
    try:
        n = len(split)
    except TypeError:
        raise ValueError(
            f"the {which} split ({type(split).__name__}) has no len(); expected a map-style Dataset with __len__"
        ) from None
    if n == 0:
        raise ValueError(f"the {which} split is empty")
    item = split[0]
    if own_collate is None:
        _check_item(item, which)
    try:  # the batch of the first item: what every step's batch will be made like
        model_inputs(batch := _OwnCollate(own_collate)([item]) if own_collate else collate([item]))
        batch_size(batch)
    except Exception as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{which} item 0 does not make a batch: {reason}") from None


def as_map_data(name: str, splits: Any) -> MapData:
    """``MapData`` from what a data target returned, ``(train, test)`` or ``(train, test, collate)``, or a
    dict of those with a validation split of its own: ``{"train": ..., "val": ..., "test": ..., "collate": ...}``
    (``test`` and ``collate`` may be left out).

    Errors say what is wrong:

    >>> as_map_data("toy", [(torch.zeros(2), 0, 1)] * 4)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
        ...
    ValueError: returned a list of 4 items; expected (train, test) or (train, test, collate):
    map-style torch Datasets (test may be None) and a function from a list of items to a batch
    """
    if isinstance(splits, Mapping):
        unknown = sorted(set(splits) - set(_SPLIT_KEYS))
        if unknown or "train" not in splits:
            raise ValueError(f"returned a dict with keys {sorted(splits)}; expected train, and val, test, collate")
        val = splits.get("val")
        splits = (splits["train"], splits.get("test"), splits.get("collate"))
    else:
        val = None
    if not isinstance(splits, (tuple, list)) or len(splits) not in (2, 3):
        kind = (
            f"a {type(splits).__name__} of {len(splits)} items"
            if isinstance(splits, (tuple, list))
            else f"a {type(splits).__name__}"
        )
        raise ValueError(
            f"returned {kind}; expected (train, test) or (train, test, collate): map-style torch Datasets "
            "(test may be None) and a function from a list of items to a batch"
        )
    train, test, own_collate = (*splits, None) if len(splits) == 2 else splits
    if own_collate is not None and not callable(own_collate):
        raise ValueError(
            f"returned a {type(own_collate).__name__} as the collate function; "
            "expected a function from a list of items to a batch"
        )
    _check_split(train, "train", own_collate)
    if test is not None:
        _check_split(test, "test", own_collate)
    if val is not None:
        _check_split(val, "val", own_collate)
    return MapData(name, train, test, own_collate, val)


_SPLIT_KEYS = ("train", "val", "test", "collate")


def _as_default_float(batch: Tensor, value: Any) -> Tensor:
    # Python floats collate to float64; models are in the default dtype (float32).
    return batch.to(torch.get_default_dtype()) if isinstance(value, float) else batch


def collate(items: list) -> Any:
    """The batch of a list of ``(input, target)`` pairs or of dicts: every part stacked along a new first dim.

    Python ints become int64 and Python floats the default float dtype.

    >>> collate([(torch.zeros(3), 1), (torch.ones(3), 0)])
    (tensor([[0., 0., 0.],
            [1., 1., 1.]]), tensor([1, 0]))
    >>> collate([(1.5, 2.0)])[1].dtype
    torch.float32
    >>> collate([{"input_ids": torch.arange(3), "labels": torch.arange(3)}] * 2)["labels"].shape
    torch.Size([2, 3])
    """
    batch = as_batch(default_collate(items))
    first = as_batch(items[0])
    if isinstance(batch, list):  # default_collate makes a list of the parts of tuple items
        batch = tuple(batch)
        first = tuple(first)
    return tree_map(_as_default_float, batch, first)


class StepSampler(Sampler):
    """Rank ``rank``'s sample indices for each optimizer step ``start_step`` to ``stop_step - 1``.

    Step ``s``'s global batch is positions ``s * G .. (s + 1) * G - 1`` of the stream of
    one permutation per epoch seeded by ``(seed, epoch)`` (the order ``global_batch``
    takes for in-memory data); rank ``r`` of ``W`` gets the ``r``-th contiguous ``G / W``
    of it. The ranks together read the same global batches in the same order for any
    world size, and a run resumed at step ``k`` starts at the exact sample an
    uninterrupted one reads there.

    >>> list(StepSampler(8, 4, seed=0, stop_step=2))  # one process: steps 0 and 1
    [[4, 7, 5, 2], [1, 0, 6, 3]]
    >>> [list(StepSampler(8, 4, seed=0, rank=r, world_size=2, stop_step=2)) for r in range(2)]
    [[[4, 7], [1, 0]], [[5, 2], [6, 3]]]
    >>> list(StepSampler(8, 4, seed=0, start_step=1, stop_step=2))  # resumed at step 1
    [[1, 0, 6, 3]]
    """

    def __init__(
        self,
        n: int,
        global_batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_step: int = 0,
        stop_step: int | None = None,
    ):
        if not 0 < global_batch_size <= n:
            raise ValueError(
                f"data.global_batch_size={global_batch_size}: expected between 1 and the {n} training samples"
            )
        check_global_batch(global_batch_size, world_size)
        self.n, self.size, self.seed = n, global_batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.start = start_step
        # Without an end the sampler never stops: one epoch has no meaning in steps.
        self.stop = stop_step

    def __len__(self) -> int:
        if self.stop is None:
            raise TypeError("StepSampler without stop_step is unbounded")
        return max(0, self.stop - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        per_rank = self.size // self.world_size
        cache: dict[int, Tensor] = {}
        step = self.start
        while self.stop is None or step < self.stop:
            first = step * self.size + self.rank * per_rank
            yield _epoch_indices(self.n, first, per_rank, self.seed, cache).tolist()
            step += 1
