"""Batches as pure functions of the step: the global batch, its ranks' shares and micro-batches.

A batch is any pytree of tensors that share their first (batch) dimension: the built-in
data's ``(inputs, targets)`` pairs, or a dict such as a Hugging Face collator's
``{"input_ids", "attention_mask", "labels"}``. Shards and micro-batches cut every tensor
alike along that dimension; ``model_inputs`` says what the model and the loss get.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from fdp._torch import tree_flatten, tree_map
from fdp.data.builtin import _EPOCH, _WINDOWS, Dataset, _generator
from fdp.errors import require


def check_global_batch(global_batch_size: int, world_size: int) -> int:
    """``data.global_batch_size`` splits evenly over ``world_size`` ranks: the size of one rank's share.

    >>> check_global_batch(10, 4)
    Traceback (most recent call last):
    ...
    ValueError: data.global_batch_size=10: expected a multiple of the world size 4
    """
    require(
        global_batch_size % world_size == 0,
        "data.global_batch_size",
        global_batch_size,
        f"a multiple of the world size {world_size}",
    )
    return global_batch_size // world_size


def check_micro_batches(per_rank: int, accum_steps: int) -> int:
    """``accum_steps`` micro-batches split a per-rank batch of ``per_rank`` samples evenly: their size.

    >>> check_micro_batches(24, 5)
    Traceback (most recent call last):
    ...
    ValueError: accum_steps=5: expected a divisor of the per-rank batch of 24 samples
    """
    require(isinstance(accum_steps, int) and accum_steps >= 1, "accum_steps", accum_steps, "an integer >= 1")
    require(
        per_rank % accum_steps == 0,
        "accum_steps",
        accum_steps,
        f"a divisor of the per-rank batch of {per_rank} samples",
    )
    return per_rank // accum_steps


LABELS = "labels"  # the entry of a dict batch the loss gets (Hugging Face's name); the rest go to the model


def global_batch(data: Dataset, step: int, global_batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """The WHOLE global batch of optimizer step ``step``: a pure function of its arguments.

    Classification: sample ``step * global_batch_size + j`` of the infinite stream made of
    one permutation per epoch (seeded by ``(seed, epoch)``), so each epoch visits every
    training sample exactly once and a batch crossing an epoch boundary wraps into the
    next epoch's permutation. Text: ``global_batch_size`` uniformly random window offsets
    drawn from a generator seeded by ``(seed, step)``.

    >>> from fdp.data import load_digits

    >>> data = load_digits()
    >>> a = global_batch(data, step=5, global_batch_size=64, seed=1)
    >>> b = global_batch(data, step=5, global_batch_size=64, seed=1)
    >>> all(torch.equal(u, v) for u, v in zip(a, b))
    True
    """
    if global_batch_size <= 0:
        raise ValueError(f"data.global_batch_size={global_batch_size!r}: expected an integer >= 1")
    if step < 0:
        raise ValueError(f"step={step!r}: expected an integer >= 0")
    if data.is_text:
        T = data.block_size
        n_windows = data.train_x.shape[0] - T  # offsets 0 .. len - T - 1 fit T + 1 chars
        offsets = torch.randint(0, n_windows, (global_batch_size,), generator=_generator(seed, _WINDOWS, step))
        windows = data.train_x[offsets[:, None] + torch.arange(T + 1)]
        return windows[:, :-1], windows[:, 1:]
    n = data.train_x.shape[0]
    if global_batch_size > n:
        raise ValueError(
            f"data.global_batch_size={global_batch_size} asks for more samples per step than the "
            f"{n} training samples of {data.name!r}"
        )
    idx = _epoch_indices(n, step * global_batch_size, global_batch_size, seed)
    return data.train_x[idx], data.train_y[idx]


def _epoch_indices(n: int, start: int, count: int, seed: int, cache: dict[int, Tensor] | None = None) -> Tensor:
    # Positions start..start+count-1 of the concatenation perm(epoch 0), perm(epoch 1), ...;
    # only the (at most two, since count <= n) epochs touched are generated. ``cache``
    # keeps them across calls of one reader; epochs before ``first`` are dropped from it.
    first, last = start // n, (start + count - 1) // n
    if cache is None:
        cache = {}
    for old in [e for e in cache if e < first]:
        del cache[old]
    for e in range(first, last + 1):
        if e not in cache:
            cache[e] = torch.randperm(n, generator=_generator(seed, _EPOCH, e))
    perms = cache[first] if first == last else torch.cat([cache[e] for e in range(first, last + 1)])
    offset = start - first * n
    return perms[offset : offset + count]


def rank_share(batch: Any, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s share of a global batch: its contiguous samples (every tensor cut alike).

    >>> x = torch.arange(8)
    >>> rank_share((x, x * 10), rank=1, world_size=4)
    (tensor([2, 3]), tensor([20, 30]))
    >>> rank_share({"input_ids": x, "labels": x * 10}, rank=3, world_size=4)
    {'input_ids': tensor([6, 7]), 'labels': tensor([60, 70])}
    """
    if world_size <= 0:
        raise ValueError(f"world_size={world_size!r}: expected an integer >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: expected an integer in [0, {world_size})")
    batch = as_batch(batch)
    per_rank = check_global_batch(batch_size(batch), world_size)
    return _rows(batch, rank * per_rank, (rank + 1) * per_rank)


def dataset_share(data: Dataset, rank: int, world_size: int, drop_last: bool = False) -> Dataset:
    """Rank ``rank``'s share of the training samples: the same number on every rank.

    The trainer never needs this (``global_batch`` + ``rank_share`` split every step's batch
    evenly); it is for code that iterates over a per-rank dataset. N samples dealt
    round-robin over W ranks (rank r takes samples r, r + W, ...) leave the first N mod W
    ranks one sample more, hence possibly one batch more per epoch: a collective that its
    peers never join, and a hang. As with ``DistributedSampler``, the shares are evened
    out: ``drop_last=False`` pads with samples wrapped around from the start (ceil(N/W)
    each, so a few samples are seen twice per epoch), ``drop_last=True`` drops the tail
    (floor(N/W) each, so a few are not seen). The test split is left whole.

    >>> from fdp.data import load_digits

    >>> data = load_digits()._replace(train_x=torch.arange(5.0)[:, None], train_y=torch.arange(5))
    >>> [dataset_share(data, r, 2).train_y.tolist() for r in range(2)]
    [[0, 2, 4], [1, 3, 0]]
    >>> [dataset_share(data, r, 2, drop_last=True).train_y.tolist() for r in range(2)]
    [[0, 2], [1, 3]]
    """
    if world_size <= 0:
        raise ValueError(f"world_size={world_size!r}: expected an integer >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: expected an integer in [0, {world_size})")
    if data.is_text:
        raise ValueError(f"dataset {data.name!r} is a token stream: use global_batch, which cuts windows per step")
    n = data.train_x.shape[0]
    per_rank = n // world_size if drop_last else -(-n // world_size)
    if per_rank == 0:
        raise ValueError(f"{n} training samples leave nothing for {world_size} ranks with drop_last=True")
    idx = (torch.arange(per_rank) * world_size + rank) % n
    return data._replace(train_x=data.train_x[idx], train_y=data.train_y[idx])


def split_micro_batches(batch: Any, accum_steps: int) -> list:
    """Split a (per-rank) batch into ``accum_steps`` equal consecutive micro-batches.

    >>> x = torch.arange(6)
    >>> split_micro_batches((x,), 3)
    [(tensor([0, 1]),), (tensor([2, 3]),), (tensor([4, 5]),)]
    """
    batch = as_batch(batch)
    micro = check_micro_batches(batch_size(batch), accum_steps)
    if accum_steps == 1:  # the batch itself: slicing it whole would only add ops to the step
        return [batch]
    return [_rows(batch, i * micro, (i + 1) * micro) for i in range(accum_steps)]


def pieces(batch: Any, size: int) -> list:
    """``batch`` in consecutive pieces of at most ``size`` samples (the batch itself when it is no larger).

    >>> [p[0].tolist() for p in pieces((torch.arange(5), torch.arange(5)), 2)]
    [[0, 1], [2, 3], [4]]
    """
    batch = as_batch(batch)
    total = batch_size(batch)
    if total <= size:
        return [batch]
    return [_rows(batch, start, min(start + size, total)) for start in range(0, total, size)]


def _tensors(batch: Any) -> bool:
    # The common (inputs, targets) pair of tensors skips the pytree walks: 6 instead of 16 us per split.
    return type(batch) is tuple and all(isinstance(t, Tensor) for t in batch)


def _rows(batch: Any, start: int, stop: int) -> Any:
    if _tensors(batch):
        return tuple(t[start:stop] for t in batch)
    return tree_map(lambda t: t[start:stop], batch)


def as_batch(batch: Any) -> Any:
    """``batch`` with every mapping a plain ``dict`` and every list or tuple a new one of the same type.

    A Hugging Face ``BatchEncoding`` is a ``UserDict``, which pytree functions would take
    for one leaf.

    >>> from collections import UserDict
    >>> as_batch(UserDict(labels=torch.zeros(2)))
    {'labels': tensor([0., 0.])}
    """
    if _tensors(batch):
        return batch
    if isinstance(batch, Mapping):
        return {key: as_batch(value) for key, value in batch.items()}
    if type(batch) in (tuple, list):
        return type(batch)(as_batch(part) for part in batch)
    return batch


def batch_size(batch: Any) -> int:
    """The batch dimension every tensor of ``batch`` shares; ``ValueError`` when they disagree or are not tensors.

    >>> batch_size({"input_ids": torch.zeros(4, 16), "labels": torch.zeros(4, 16)})
    4
    """
    leaves = list(batch) if _tensors(batch) else tree_flatten(batch)[0]
    kinds = {type(leaf).__name__ for leaf in leaves if not isinstance(leaf, Tensor)}
    if kinds or not leaves:
        raise ValueError(
            f"batch holds {', '.join(sorted(kinds)) or 'no tensors'}; "
            "expected tensors (a pytree of them) that share a batch dimension"
        )
    sizes = {t.shape[0] if t.dim() else None for t in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"batch tensors disagree on the batch dimension: {describe(batch)}")
    return sizes.pop()


def model_inputs(batch: Any) -> tuple[tuple, dict, Any]:
    """What a batch gives the model and the loss: ``(positional inputs, keyword inputs, targets)``.

    A dict is Hugging Face's convention: every entry but ``labels`` goes to the model by
    name (``input_ids=..., attention_mask=...``) and ``labels`` to the loss. A pair is
    ``(inputs, targets)``: a dict of inputs goes by name, anything else as the one
    positional input.

    >>> x, y = torch.zeros(2, 3), torch.zeros(2)
    >>> model_inputs((x, y))[0][0] is x
    True
    >>> args, kwargs, targets = model_inputs({"input_ids": x, "attention_mask": x, "labels": y})
    >>> args, sorted(kwargs), targets is y
    ((), ['attention_mask', 'input_ids'], True)
    """
    if isinstance(batch, Mapping):
        if LABELS not in batch:
            raise ValueError(
                f"a dict batch with entries {sorted(batch)} has no {LABELS!r} entry; "
                f"expected the targets of the loss under {LABELS!r}"
            )
        return (), {key: value for key, value in batch.items() if key != LABELS}, batch[LABELS]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        if isinstance(inputs, Mapping):
            return (), dict(inputs), targets
        return (inputs,), {}, targets
    kind = f"a {len(batch)}-tuple" if isinstance(batch, (tuple, list)) else f"a {type(batch).__name__}"
    raise ValueError(f"the batch is {kind}; expected a pair (inputs, targets) or a dict with a {LABELS!r} entry")


def head(batch: Any, count: int) -> Any:
    """The first ``count`` samples of ``batch`` (all of them if it has fewer).

    >>> head((torch.arange(5), torch.arange(5)), 2)
    (tensor([0, 1]), tensor([0, 1]))
    """
    return _rows(as_batch(batch), 0, count)


def describe(batch: Any) -> str:
    """Shapes and dtypes of a batch's tensors, for messages.

    >>> describe((torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64)))
    'inputs (4, 8) float32, targets (4,) int64'
    >>> describe({"input_ids": torch.zeros(2, 3, dtype=torch.int64)})
    'input_ids (2, 3) int64'
    """
    batch = as_batch(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and not isinstance(batch[0], Mapping):
        named = {"inputs": batch[0], "targets": batch[1]}
    elif isinstance(batch, Mapping):
        named = batch
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        named = {**batch[0], "targets": batch[1]}
    else:
        named = {"batch": batch}
    return ", ".join(f"{name} {_shape_and_dtype(value)}" for name, value in named.items())


def _shape_and_dtype(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__
