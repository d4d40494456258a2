"""Deterministic offline data, with batches defined by the GLOBAL batch size.

Every batch is a pure function of its arguments: ``global_batch(data, step, size, seed)``
builds the whole batch of optimizer step ``step`` from local generators, so a run resumed
at step k sees exactly the batches of an uninterrupted one, whatever the world size.
Ranks then take their contiguous ``shard`` and may split it into micro-batches.
A user's own data (``MapData``: map-style torch Datasets) is read through a ``DataLoader``
whose ``StepSampler`` follows the same order, so the same holds for it.

>>> data = load_dataset("digits")
>>> x, y = global_batch(data, step=0, global_batch_size=8, seed=0)
>>> [t.shape for t in shard((x, y), rank=1, world_size=2)]
[torch.Size([4, 64]), torch.Size([4])]
"""
from __future__ import annotations

import itertools
import os
import sysconfig
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, Sampler
from torch.utils.data import Dataset as TorchDataset
from torch.utils.data import default_collate

__all__ = [
    "Dataset",
    "load_digits",
    "load_stdlib_text",
    "global_batch",
    "shard",
    "shard_dataset",
    "split_micro_batches",
    "eval_batches",
    "load_dataset",
    "MapData",
    "StepSampler",
    "as_map_data",
    "collate",
    "train_batches",
    "num_train_samples",
    "has_test_split",
    "model_arguments",
    "DATASETS",
    "STDLIB_TEXT_MODULES",
]


class Dataset(NamedTuple):
    """An in-memory dataset.

    Classification: ``train_x``/``test_x`` are samples and ``train_y``/``test_y`` int64
    labels; ``block_size`` is ``None``.
    Text: ``train_x``/``test_x`` are 1-D int64 token streams and ``train_y``/``test_y``
    are the very same tensors (targets are the stream shifted by one, cut out per
    window); ``num_classes`` is the vocabulary size, ``vocab[i]`` the character of
    token ``i`` and ``block_size`` the window length T.

    >>> data = load_digits()
    >>> data.name, data.num_classes, data.is_text
    ('digits', 10, False)
    """

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor | None
    test_y: Tensor | None
    num_classes: int
    block_size: int | None = None
    vocab: str | None = None

    @property
    def is_text(self) -> bool:
        """Whether samples are windows of a token stream (``block_size`` is set).

        >>> load_stdlib_text(max_chars=1000).is_text
        True
        """
        return self.block_size is not None

    def decode(self, tokens: Tensor) -> str:
        """Characters of a 1-D token tensor (text datasets only).

        >>> data = load_stdlib_text(max_chars=1000)
        >>> data.decode(data.train_x[:10]) == _stdlib_text(1000)[:10]
        True
        """
        if self.vocab is None:
            raise ValueError(f"dataset {self.name!r} has no vocabulary")
        return "".join(self.vocab[i] for i in tokens.tolist())


# Domain tags keep the generators of different uses apart even for equal (seed, n).
_SPLIT, _EPOCH, _WINDOWS = 0, 1, 2


def _generator(seed: int, tag: int, n: int) -> torch.Generator:
    # SeedSequence hashes (seed, tag, n) into well-mixed state; plain arithmetic like
    # seed*K + n would collide across (seed, epoch) pairs and correlate neighbours.
    words = [seed % 2**64, tag, n % 2**64]
    state = np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


def _check_fraction(test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")


def load_digits(seed: int = 0, test_fraction: float = 0.2, flatten: bool = True) -> Dataset:
    """scikit-learn's bundled 8×8 digits (1797 images, offline), split and standardised.

    Pixels are scaled to [0, 1], the split is a permutation seeded by ``seed`` (the last
    ``round(N * test_fraction)`` shuffled samples are the test set), then every pixel
    is standardised with TRAIN mean/std only, so no test statistics leak into training.
    ``flatten=False`` gives images shaped (N, 1, 8, 8) instead of (N, 64).

    >>> data = load_digits(seed=0)
    >>> tuple(data.train_x.shape), tuple(data.test_x.shape), data.train_x.dtype
    ((1438, 64), (359, 64), torch.float32)
    """
    from sklearn.datasets import load_digits as _sk_load_digits

    _check_fraction(test_fraction)
    raw = _sk_load_digits()
    x = torch.as_tensor(raw.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(raw.target, dtype=torch.int64)
    n = x.shape[0]
    n_test = int(round(n * test_fraction))
    if not 0 < n_test < n:
        raise ValueError(f"test_fraction={test_fraction} leaves an empty split of {n} samples")
    train_idx, test_idx = _digits_split(n, n_test, seed)
    train_x, test_x = x[train_idx], x[test_idx]
    mean = train_x.mean(0)
    std = train_x.std(0)
    # Border pixels are always blank in the training set: std 0 would divide by zero.
    std = torch.where(std > 0, std, torch.ones_like(std))
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    if not flatten:
        train_x, test_x = train_x.reshape(-1, 1, 8, 8), test_x.reshape(-1, 1, 8, 8)
    return Dataset("digits", train_x.contiguous(), y[train_idx], test_x.contiguous(), y[test_idx], 10)


def _digits_split(n: int, n_test: int, seed: int) -> tuple[Tensor, Tensor]:
    perm = torch.randperm(n, generator=_generator(seed, _SPLIT, 0))
    return perm[: n - n_test], perm[n - n_test :]


# Kept sorted and limited to pure-Python modules present in CPython 3.10-3.13, so the
# text is available everywhere; the file contents still change between minor versions.
STDLIB_TEXT_MODULES: tuple[str, ...] = tuple(
    sorted(
        """abc argparse ast base64 bisect calendar cmd codecs colorsys configparser contextlib
        copy csv dataclasses datetime difflib dis enum fnmatch fractions ftplib functools getopt
        gettext glob gzip heapq hmac inspect ipaddress locale mailbox mimetypes numbers operator
        optparse os pdb pickle pprint queue random reprlib sched secrets selectors shlex shutil
        smtplib socket statistics string subprocess tarfile tempfile textwrap threading timeit
        tokenize traceback types typing uuid warnings weakref""".split()
    )
)


def _stdlib_text(max_chars: int) -> str:
    root = sysconfig.get_paths()["stdlib"]
    parts: list[str] = []
    total = 0
    for module in STDLIB_TEXT_MODULES:
        if total >= max_chars:
            break  # stop early: reading files we would truncate away is the slow part
        path = os.path.join(root, module + ".py")
        if not os.path.isfile(path):
            path = os.path.join(root, module, "__init__.py")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"stdlib module {module!r} not found under {root}")
        # Universal-newline reading: CRLF checkouts (Windows) give the same text.
        with open(path, encoding="utf-8") as f:
            text = f.read()
        parts.append(text)
        total += len(text)
    return "".join(parts)[:max_chars]


def load_stdlib_text(block_size: int = 64, max_chars: int = 1_000_000, seed: int = 0, test_fraction: float = 0.1) -> Dataset:
    """Character-level text from the Python standard library's own ``.py`` sources.

    The modules in ``STDLIB_TEXT_MODULES`` are read from ``sysconfig.get_paths()["stdlib"]``
    in that (sorted) order and concatenated up to ``max_chars`` characters. The text, hence
    the vocabulary and every batch, DEPENDS ON THE PYTHON MINOR VERSION (3.11 and 3.12 ship
    different sources); it is identical on machines with the same minor version. The
    vocabulary is the sorted set of characters; the last ``test_fraction`` of the stream
    is the test split. Samples are windows of ``block_size + 1`` characters
    (``x = t[i:i+T]``, ``y = t[i+1:i+T+1]``), cut out at batch time from the stored streams.
    ``seed`` is accepted for a uniform ``load_dataset`` interface; the text itself is fixed.
    Nothing is cached on disk.

    >>> data = load_stdlib_text(block_size=32, max_chars=20_000)
    >>> data.train_x.shape[0] + data.test_x.shape[0], data.block_size
    (20000, 32)
    """
    del seed  # the split is by position, so there is nothing to randomise
    _check_fraction(test_fraction)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    text = _stdlib_text(max_chars)
    vocab = "".join(sorted(set(text)))
    # Vectorised char -> id mapping: a Python-level dict lookup per char costs ~0.1 s per 1M chars.
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab_codes = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)
    tokens = torch.from_numpy(np.searchsorted(vocab_codes, codes).astype(np.int64))
    n_test = int(len(tokens) * test_fraction)
    n_train = len(tokens) - n_test
    if min(n_train, n_test) < block_size + 1:
        raise ValueError(
            f"max_chars={max_chars} gives {n_train} train / {n_test} test characters; "
            f"each split needs at least block_size + 1 = {block_size + 1}"
        )
    train, test = tokens[:n_train], tokens[n_train:]
    return Dataset("stdlib_text", train, train, test, test, len(vocab), block_size=block_size, vocab=vocab)


def global_batch(data: Dataset, step: int, global_batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """The WHOLE global batch of optimizer step ``step``: a pure function of its arguments.

    Classification: sample ``step * global_batch_size + j`` of the infinite stream made of
    one permutation per epoch (seeded by ``(seed, epoch)``), so each epoch visits every
    training sample exactly once and a batch crossing an epoch boundary wraps into the
    next epoch's permutation. Text: ``global_batch_size`` uniformly random window offsets
    drawn from a generator seeded by ``(seed, step)``.

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
    micro = size // accum_steps
    return [tuple(t[i * micro : (i + 1) * micro] for t in batch) for i in range(accum_steps)]


def _batch_size(batch: tuple[Tensor, ...]) -> int:
    sizes = {t.shape[0] for t in batch}
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on the batch dimension: {sorted(sizes)}")
    return sizes.pop()


# -- a user's own data: map-style torch Datasets through a DataLoader ----------------------
class MapData(NamedTuple):
    """Train and test splits as map-style ``torch.utils.data.Dataset``s of ``(input, target)`` items.

    Inputs and targets are tensors, numbers or NumPy arrays; ``test`` may be ``None``.
    Items are read by index through a ``DataLoader`` (``train_batches``), so a split need
    not fit in memory. A split may carry ``num_classes`` (or torchvision's ``classes``),
    ``vocab_size`` or ``block_size`` attributes for the model's constructor
    (``model_arguments``).

    >>> from torch.utils.data import TensorDataset
    >>> data = as_map_data("toy", (TensorDataset(torch.randn(10, 3), torch.arange(10) % 2), None))
    >>> len(data.train), has_test_split(data)
    (10, False)
    """

    name: str
    train: TorchDataset
    test: TorchDataset | None


def _check_split(split: Any, which: str) -> None:
    if isinstance(split, IterableDataset) or not hasattr(split, "__getitem__"):
        raise ValueError(f"the {which} split is a {type(split).__name__}; expected a map-style torch Dataset (items by index)")
    try:
        n = len(split)
    except TypeError:
        raise ValueError(f"the {which} split ({type(split).__name__}) has no len(); expected a map-style Dataset with __len__") from None
    if n == 0:
        raise ValueError(f"the {which} split is empty")
    item = split[0]
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        kind = f"a {len(item)}-tuple" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}"
        raise ValueError(f"{which} item 0 is {kind}; expected a pair (input, target)")
    for part, value in zip(("input", "target"), item):
        if not isinstance(value, (Tensor, int, float, bool, np.ndarray, np.number)):
            raise ValueError(f"{which} item 0: its {part} is a {type(value).__name__}; expected a tensor, a number or an array")


def as_map_data(name: str, splits: Any) -> MapData:
    """``MapData`` from what a data target returned, ``(train, test)``; errors say what is wrong.

    >>> as_map_data("toy", [(torch.zeros(2), 0, 1)] * 3)
    Traceback (most recent call last):
        ...
    ValueError: returned a list of 3 items; expected (train, test): two map-style torch Datasets (test may be None)
    """
    if not isinstance(splits, (tuple, list)) or len(splits) != 2:
        kind = f"a {type(splits).__name__} of {len(splits)} items" if isinstance(splits, (tuple, list)) else f"a {type(splits).__name__}"
        raise ValueError(f"returned {kind}; expected (train, test): two map-style torch Datasets (test may be None)")
    train, test = splits
    _check_split(train, "train")
    if test is not None:
        _check_split(test, "test")
    return MapData(name, train, test)


def _as_default_float(batch: Tensor, value: Any) -> Tensor:
    # Python floats collate to float64; models are in the default dtype (float32).
    return batch.to(torch.get_default_dtype()) if isinstance(value, float) else batch


def collate(items: list) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` of a list of ``(input, target)`` items, stacked along a new first dim.

    Python ints become int64 and Python floats the default float dtype.

    >>> collate([(torch.zeros(3), 1), (torch.ones(3), 0)])
    (tensor([[0., 0., 0.],
            [1., 1., 1.]]), tensor([1, 0]))
    >>> collate([(1.5, 2.0)])[1].dtype
    torch.float32
    """
    inputs, targets = default_collate(items)
    return _as_default_float(inputs, items[0][0]), _as_default_float(targets, items[0][1])


class StepSampler(Sampler):
    """Rank ``rank``'s sample indices for each optimizer step ``start_step .. stop_step - 1``.

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
        self, n: int, global_batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
        start_step: int = 0, stop_step: int | None = None,
    ):
        if not 0 < global_batch_size <= n:
            raise ValueError(f"data.global_batch_size={global_batch_size}: expected between 1 and the {n} training samples")
        if global_batch_size % world_size:
            raise ValueError(f"data.global_batch_size={global_batch_size} is not divisible by the world size {world_size}")
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


def train_batches(
    data: Dataset | MapData, global_batch_size: int, seed: int, rank: int, world_size: int,
    start_step: int, stop_step: int, num_workers: int = 0, pin_memory: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """This rank's batch of each step ``start_step .. stop_step - 1``.

    In-memory data is cut by ``global_batch`` and ``shard``; ``MapData`` is read through
    a ``DataLoader`` over a ``StepSampler`` (same order rule) with ``num_workers`` worker
    processes and, for a GPU, ``pin_memory``.

    >>> from torch.utils.data import TensorDataset
    >>> digits = load_digits()
    >>> as_items = as_map_data("digits", (TensorDataset(digits.train_x, digits.train_y), None))
    >>> a = next(train_batches(digits, 8, 0, rank=1, world_size=2, start_step=3, stop_step=4))
    >>> b = next(train_batches(as_items, 8, 0, rank=1, world_size=2, start_step=3, stop_step=4))
    >>> all(torch.equal(u, v) for u, v in zip(a, b))
    True
    """
    if isinstance(data, Dataset):
        return (shard(global_batch(data, step, global_batch_size, seed), rank, world_size) for step in range(start_step, stop_step))
    sampler = StepSampler(len(data.train), global_batch_size, seed, rank, world_size, start_step, stop_step)
    # The generator only seeds the workers (random transforms inside a dataset); the order is the sampler's.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    loader = DataLoader(
        data.train, batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory, collate_fn=collate,
        generator=generator,
    )
    return iter(loader)


def num_train_samples(data: Dataset | MapData) -> int:
    """Samples in the training split (characters for a text stream).

    >>> num_train_samples(load_digits())
    1438
    """
    return len(data.train) if isinstance(data, MapData) else data.train_x.shape[0]


def has_test_split(data: Dataset | MapData) -> bool:
    """Whether ``data`` has a test split to evaluate on.

    >>> has_test_split(load_digits())
    True
    """
    if isinstance(data, MapData):
        return data.test is not None
    return data.test_x is not None and data.test_y is not None


def model_arguments(data: Dataset | MapData) -> dict[str, Any]:
    """What the data tells a model's constructor (``None`` where it cannot tell).

    ``in_features`` (elements of one input), ``in_channels`` (its first dim, 1 for a
    vector), ``num_classes`` and ``vocab_size`` (from the dataset, or a split's
    ``num_classes`` / ``classes`` / ``vocab_size`` attributes), ``block_size`` and
    ``out_features`` (the classes for integer targets, the elements of one target for
    real-valued ones).

    >>> args = model_arguments(load_digits())
    >>> args["in_features"], args["in_channels"], args["num_classes"], args["out_features"]
    (64, 1, 10, 10)
    """
    if isinstance(data, Dataset):
        if data.is_text:
            return {"vocab_size": data.num_classes, "block_size": data.block_size, "num_classes": data.num_classes,
                    "out_features": data.num_classes, "in_features": None, "in_channels": None}
        x = data.train_x[0]
        return {"in_features": x.numel(), "in_channels": x.shape[0] if x.dim() >= 2 else 1,
                "num_classes": data.num_classes, "out_features": data.num_classes, "vocab_size": None, "block_size": None}
    inputs, targets = collate([data.train[0]])
    x, y = inputs[0], targets[0]
    classes = getattr(data.train, "num_classes", None)
    if classes is None and hasattr(data.train, "classes"):
        classes = len(data.train.classes)
    real = y.is_floating_point()
    return {
        "in_features": x.numel(),
        "in_channels": x.shape[0] if x.dim() >= 2 else 1,
        "num_classes": classes,
        "out_features": y.numel() if real else classes,
        "vocab_size": getattr(data.train, "vocab_size", None),
        "block_size": getattr(data.train, "block_size", None),
    }


def eval_batches(
    data: Dataset | MapData, batch_size: int, max_batches: int | None = None, num_workers: int = 0
) -> Iterator[tuple[Tensor, Tensor]]:
    """Deterministic in-order batches of the test split (the last one may be smaller).

    Text: consecutive non-overlapping windows ``x = t[jT:(j+1)T]``, ``y = t[jT+1:(j+1)T+1]``.
    ``max_batches`` stops early (``None``: the whole split). A ``MapData`` test split is
    read through a ``DataLoader`` with ``num_workers`` workers.

    >>> data = load_digits()
    >>> sum(len(y) for _, y in eval_batches(data, batch_size=100))
    359
    """
    if not has_test_split(data):
        raise ValueError(f"dataset {data.name!r} has no test split")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if isinstance(data, MapData):
        loader = DataLoader(data.test, batch_size=batch_size, num_workers=num_workers, collate_fn=collate)
        return itertools.islice(loader, max_batches)
    return _in_memory_eval_batches(data, batch_size, max_batches)


def _in_memory_eval_batches(data: Dataset, batch_size: int, max_batches: int | None) -> Iterator[tuple[Tensor, Tensor]]:
    if data.is_text:
        T = data.block_size
        n_windows = (data.test_x.shape[0] - 1) // T
        starts = torch.arange(n_windows) * T
    else:
        n_windows = data.test_x.shape[0]
    n_batches = -(-n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        lo, hi = b * batch_size, min((b + 1) * batch_size, n_windows)
        if data.is_text:
            windows = data.test_x[starts[lo:hi, None] + torch.arange(T + 1)]
            yield windows[:, :-1], windows[:, 1:]
        else:
            yield data.test_x[lo:hi], data.test_y[lo:hi]


DATASETS: dict[str, Callable[..., Dataset]] = {
    "digits": load_digits,
    "stdlib_text": load_stdlib_text,
}


def load_dataset(name: str, **kwargs) -> Dataset:
    """Load a dataset by name (``digits``, ``stdlib_text``) with its keyword args.

    >>> load_dataset("digits", flatten=False).train_x.shape[1:]
    torch.Size([1, 8, 8])
    >>> load_dataset("mnist")
    Traceback (most recent call last):
        ...
    ValueError: unknown dataset 'mnist'; known datasets: digits, stdlib_text
    """
    try:
        loader = DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(sorted(DATASETS))}") from None
    return loader(**kwargs)
