"""Batches as pure functions of the step: the global batch, its shards and micro-batches."""
from __future__ import annotations

import torch
from torch import Tensor

from fdp.data.builtin import _EPOCH, _WINDOWS, Dataset, _generator


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
        raise ValueError(f"data.global_batch_size must be positive, got {global_batch_size}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
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


def shard(batch: tuple[Tensor, ...], rank: int, world_size: int) -> tuple[Tensor, ...]:
    """Rank ``rank``'s contiguous slice of a global batch (every tensor sliced alike).

    >>> x = torch.arange(8)
    >>> shard((x, x * 10), rank=1, world_size=4)
    (tensor([2, 3]), tensor([20, 30]))
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    size = _batch_size(batch)
    if size % world_size:
        raise ValueError(
            f"data.global_batch_size={size} is not divisible by the world size {world_size}; "
            f"choose a multiple of {world_size}"
        )
    per_rank = size // world_size
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)


def shard_dataset(data: Dataset, rank: int, world_size: int, drop_last: bool = False) -> Dataset:
    """Rank ``rank``'s share of the training samples: the same number on every rank.

    The trainer never needs this (``global_batch`` + ``shard`` split every step's batch
    evenly); it is for code that iterates over a per-rank dataset. N samples dealt
    round-robin over W ranks (rank r takes samples r, r + W, ...) leave the first N mod W
    ranks one sample more, hence possibly one batch more per epoch: a collective that its
    peers never join, and a hang. As with ``DistributedSampler``, the shards are evened
    out: ``drop_last=False`` pads with samples wrapped around from the start (ceil(N/W)
    each, so a few samples are seen twice per epoch), ``drop_last=True`` drops the tail
    (floor(N/W) each, so a few are not seen). The test split is left whole.

    >>> from fdp.data import load_digits

    >>> data = load_digits()._replace(train_x=torch.arange(5.0)[:, None], train_y=torch.arange(5))
    >>> [shard_dataset(data, r, 2).train_y.tolist() for r in range(2)]
    [[0, 2, 4], [1, 3, 0]]
    >>> [shard_dataset(data, r, 2, drop_last=True).train_y.tolist() for r in range(2)]
    [[0, 2], [1, 3]]
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if data.is_text:
        raise ValueError(f"dataset {data.name!r} is a token stream: use global_batch, which cuts windows per step")
    n = data.train_x.shape[0]
    per_rank = n // world_size if drop_last else -(-n // world_size)
    if per_rank == 0:
        raise ValueError(f"{n} training samples leave nothing for {world_size} ranks with drop_last=True")
    idx = (torch.arange(per_rank) * world_size + rank) % n
    return data._replace(train_x=data.train_x[idx], train_y=data.train_y[idx])


def split_micro_batches(batch: tuple[Tensor, ...], accum_steps: int) -> list[tuple[Tensor, ...]]:
    """Split a (per-rank) batch into ``accum_steps`` equal consecutive micro-batches.

    >>> x = torch.arange(6)
    >>> split_micro_batches((x,), 3)
    [(tensor([0, 1]),), (tensor([2, 3]),), (tensor([4, 5]),)]
    """
    if accum_steps <= 0:
        raise ValueError(f"accum_steps={accum_steps!r}: expected an integer >= 1")
    size = _batch_size(batch)
    if size % accum_steps:
        raise ValueError(
            f"accum_steps={accum_steps}: expected a divisor of the per-rank batch of {size} samples"
        )
    if accum_steps == 1:  # the batch itself: slicing it whole would only add ops to the step
        return [tuple(batch)]
    micro = size // accum_steps
    return [tuple(t[i * micro : (i + 1) * micro] for t in batch) for i in range(accum_steps)]


def _batch_size(batch: tuple[Tensor, ...]) -> int:
    sizes = {t.shape[0] for t in batch}
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on the batch dimension: {sorted(sizes)}")
    return sizes.pop()
