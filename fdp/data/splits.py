"""The validation split: held out of the training split by seed (``data.val_fraction``), or the data's own.

Evaluations during training score the validation split (``val_*`` metrics), so model selection
(early stopping, the best checkpoints) never looks at the test split, which a run scores once at
its end. The part held out is a pure function of the training split's size, the fraction and the
seed: every rank, every world size and every resumed invocation hold out the same samples.

>>> from fdp.data import load_digits
>>> data = hold_out(load_digits(), 0.1, seed=0, global_batch_size=64)
>>> len(data.train_x), len(data.val_x), has_split(data, "val")
(1294, 144, True)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import Subset

from fdp.data.builtin import _VALIDATION, Dataset, _generator
from fdp.data.mapped import MapData
from fdp.errors import require

__all__ = ["SPLITS", "check_val_fraction", "has_split", "hold_out", "own_val_split"]

SPLITS = ("val", "test")  # what an evaluation scores: its metrics are named <split>_loss, <split>_acc...
VAL_FRACTION = 0.1  # held out where the data has no validation split of its own and data.val_fraction is unset


def has_split(data: Dataset | MapData, split: str) -> bool:
    """Whether ``data`` has the split ``split`` (``val`` or ``test``) to evaluate on.

    >>> from fdp.data import load_digits
    >>> has_split(load_digits(), "test"), has_split(load_digits(), "val")
    (True, False)
    """
    require(split in SPLITS, "split", split, " or ".join(SPLITS))
    if isinstance(data, MapData):
        return getattr(data, split) is not None
    return getattr(data, f"{split}_x") is not None and getattr(data, f"{split}_y") is not None


def own_val_split(data: Dataset | MapData) -> bool:
    """Whether the data came with a validation split of its own (then nothing is held out of training)."""
    return has_split(data, "val")


def check_val_fraction(value: Any) -> float | None:
    """``data.val_fraction``: a fraction in [0, 1) of the training split to hold out (0: none), or
    ``None``: 0.1, or the data's own validation split where it has one.

    >>> check_val_fraction(1.0)
    Traceback (most recent call last):
    ...
    ValueError: data.val_fraction=1.0: expected a fraction in [0, 1) or null (0.1, or the data's own split)
    """
    if value is None:
        return None
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else -1.0
    ok = math.isfinite(number) and 0.0 <= number < 1.0
    require(ok, "data.val_fraction", value, "a fraction in [0, 1) or null (0.1, or the data's own split)")
    return float(number)


def hold_out(data: Dataset | MapData, fraction: float | None, seed: int, global_batch_size: int) -> Dataset | MapData:
    """``data`` with a validation split: ``fraction`` of its training split held out (``None``: 0.1,
    none where the data has its own validation split; 0: none).

    Samples are held out by a permutation seeded by ``seed`` (each part keeps the training split's
    order); a text stream, whose windows overlap, gives its last ``fraction`` of characters, as its
    test split is cut. Each part must keep at least one batch: ``global_batch_size`` samples (a window
    of ``block_size + 1`` characters for text) to train on, one to validate on.

    >>> from fdp.data import load_digits
    >>> hold_out(load_digits(), 0.99, seed=0, global_batch_size=64)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: data.val_fraction=0.99: expected a part of the 1438 training samples leaving a batch on each side ...
    """
    if own_val_split(data):
        require(fraction is None, "data.val_fraction", fraction, "null for data with a validation split of its own")
        return data
    fraction = VAL_FRACTION if fraction is None else check_val_fraction(fraction)
    if not fraction:
        return data
    if isinstance(data, Dataset) and data.is_text:
        return _hold_out_text(data, fraction)
    n = len(data.train) if isinstance(data, MapData) else data.train_x.shape[0]
    n_val = int(round(n * fraction))
    if global_batch_size > n:  # no split leaves such a batch: the batch's own check names it (check_global_batch)
        return data
    require(
        n_val >= 1 and n - n_val >= global_batch_size,
        "data.val_fraction",
        fraction,
        f"a part of the {n} training samples leaving a batch on each side (data.global_batch_size={global_batch_size} "
        f"to train on, 1 to validate on; it holds out {n_val}, leaving {n - n_val})",
    )
    held = torch.zeros(n, dtype=torch.bool)
    held[torch.randperm(n, generator=_generator(seed, _VALIDATION, n))[:n_val]] = True
    train, val = (~held).nonzero().flatten(), held.nonzero().flatten()
    if isinstance(data, MapData):
        return data._replace(train=HeldOut(data.train, train.tolist()), val=HeldOut(data.train, val.tolist()))
    return data._replace(
        train_x=data.train_x[train], train_y=data.train_y[train], val_x=data.train_x[val], val_y=data.train_y[val]
    )


def _hold_out_text(data: Dataset, fraction: float) -> Dataset:
    n = data.train_x.shape[0]
    n_val, window = int(n * fraction), data.block_size + 1
    require(
        min(n_val, n - n_val) >= window,
        "data.val_fraction",
        fraction,
        f"a part of the {n} training characters leaving a window of block_size + 1 = {window} on each side "
        f"(it holds out {n_val}, leaving {n - n_val})",
    )
    train, val = data.train_x[: n - n_val], data.train_x[n - n_val :]
    return data._replace(train_x=train, train_y=train, val_x=val, val_y=val)


class HeldOut(Subset):
    """Part of a map-style split, with the split's own attributes (``num_classes``, ``targets_shifted``...)
    that the model's constructor and the checks read (``fdp.data.model_arguments``)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "indices"):  # not set yet while unpickling
            raise AttributeError(name)
        return getattr(self.dataset, name)
