"""Train and test batches of either kind of data (in memory or a user's own), and what the model learns from it."""

from __future__ import annotations

import itertools
import signal
import sys
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from fdp.data.batches import global_batch, model_inputs, rank_share
from fdp.data.builtin import Dataset
from fdp.data.mapped import MapData, StepSampler
from fdp.data.splits import has_split


def train_batches(
    data: Dataset | MapData,
    global_batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    start_step: int,
    stop_step: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[Any]:
    """This rank's batch of each step ``start_step .. stop_step - 1``.

    In-memory data is cut by ``global_batch`` and ``rank_share``; ``MapData`` is read through
    a ``DataLoader`` over a ``StepSampler`` (same order rule) with ``num_workers`` worker
    processes and, for a GPU, ``pin_memory``.

    >>> from fdp.data import load_digits, as_map_data

    >>> from torch.utils.data import TensorDataset
    >>> digits = load_digits()
    >>> as_items = as_map_data("digits", (TensorDataset(digits.train_x, digits.train_y), None))
    >>> a = next(train_batches(digits, 8, 0, rank=1, world_size=2, start_step=3, stop_step=4))
    >>> b = next(train_batches(as_items, 8, 0, rank=1, world_size=2, start_step=3, stop_step=4))
    >>> all(torch.equal(u, v) for u, v in zip(a, b))
    True
    """
    if isinstance(data, Dataset):
        return (
            rank_share(global_batch(data, step, global_batch_size, seed), rank, world_size)
            for step in range(start_step, stop_step)
        )
    sampler = StepSampler(len(data.train), global_batch_size, seed, rank, world_size, start_step, stop_step)
    # The generator only seeds the workers (random transforms inside a dataset); the order is the sampler's.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    loader = DataLoader(
        data.train,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=data.collate_fn(),
        generator=generator,
        **worker_options(num_workers),
    )
    return iter(loader)


def _ignore_sigint(worker_id: int) -> None:
    # A Ctrl-C reaches every process of the terminal's group: the training process stops
    # at a step boundary (fdp.procs.interrupt) and still needs its loader's workers until then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def worker_options(num_workers: int) -> dict[str, Any]:
    """How a ``DataLoader``'s worker processes start: forked on Linux, ignoring Ctrl-C.

    A rank of a local world is itself started by ``spawn``, and its DataLoader would
    inherit that start method: each worker then re-imports torch and the user's modules
    (~9 s per loader on two cores). Forking starts them at once, as on any Linux process.

    >>> worker_options(0)
    {}
    """
    if num_workers == 0:
        return {}
    options: dict[str, Any] = {"worker_init_fn": _ignore_sigint}
    if sys.platform.startswith("linux"):
        options["multiprocessing_context"] = "fork"
    return options


def num_train_samples(data: Dataset | MapData) -> int:
    """Samples in the training split (characters for a text stream).

    >>> from fdp.data import load_digits

    >>> num_train_samples(load_digits())
    1438
    """
    return len(data.train) if isinstance(data, MapData) else data.train_x.shape[0]


def has_test_split(data: Dataset | MapData) -> bool:
    """Whether ``data`` has a test split to evaluate on.

    >>> from fdp.data import load_digits

    >>> has_test_split(load_digits())
    True
    """
    return has_split(data, "test")


def model_arguments(data: Dataset | MapData) -> dict[str, Any]:
    """What the data tells a model's constructor (``None`` where it cannot tell).

    ``in_features`` (elements of one input), ``in_channels`` (its first dim, 1 for a
    vector), ``num_classes`` and ``vocab_size`` (from the dataset, or a split's
    ``num_classes`` / ``classes`` / ``vocab_size`` attributes), ``block_size`` and
    ``out_features`` (the classes for integer targets, the elements of one target for
    real-valued ones). For dict items the input is the first entry besides ``labels``.

    >>> from fdp.data import load_digits

    >>> args = model_arguments(load_digits())
    >>> args["in_features"], args["in_channels"], args["num_classes"], args["out_features"]
    (64, 1, 10, 10)
    """
    if isinstance(data, Dataset):
        if data.is_text:
            return {
                "vocab_size": data.num_classes,
                "block_size": data.block_size,
                "num_classes": data.num_classes,
                "out_features": data.num_classes,
                "in_features": None,
                "in_channels": None,
            }
        x = data.train_x[0]
        return {
            "in_features": x.numel(),
            "in_channels": x.shape[0] if x.dim() >= 2 else 1,
            "num_classes": data.num_classes,
            "out_features": data.num_classes,
            "vocab_size": None,
            "block_size": None,
        }
    args, kwargs, targets = model_inputs(data.collate_fn()([data.train[0]]))
    # The first input (by position, else by name): for a dict of token ids, the ids.
    first = args[0] if args else next(iter(kwargs.values()), None)
    x = first[0] if isinstance(first, Tensor) else torch.zeros(0)
    y = targets[0]
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


def targets_shifted(data: Dataset | MapData) -> bool | None:
    """Whether the data says its targets are already its inputs shifted by one, the next tokens.

    ``None``: it does not say.

    A ``MapData`` says so with a ``targets_shifted`` attribute on its train split.

    >>> from fdp.data import load_digits, load_stdlib_text
    >>> targets_shifted(load_digits()), targets_shifted(load_stdlib_text(max_chars=1000, block_size=8))
    (False, True)
    """
    if isinstance(data, Dataset):
        return data.targets_shifted
    said = getattr(data.train, "targets_shifted", None)
    return None if said is None else bool(said)


def eval_batches(
    data: Dataset | MapData, batch_size: int, max_batches: int | None = None, num_workers: int = 0, split: str = "test"
) -> Iterator[Any]:
    """Deterministic in-order batches of the test split, or of ``split`` (``val``), the last one maybe smaller.

    Text: consecutive non-overlapping windows ``x = t[jT:(j+1)T]``, ``y = t[jT+1:(j+1)T+1]``.
    ``max_batches`` stops early (``None``: the whole split). A ``MapData`` test split is
    read through a ``DataLoader`` with ``num_workers`` workers.

    >>> from fdp.data import load_digits

    >>> data = load_digits()
    >>> sum(len(y) for _, y in eval_batches(data, batch_size=100))
    359
    """
    if not has_split(data, split):
        raise ValueError(f"dataset {data.name!r} has no {split} split")
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r}: expected an integer >= 1")
    if isinstance(data, MapData):
        loader = _eval_loader(getattr(data, split), batch_size, num_workers, data.collate_fn())
        return itertools.islice(loader, max_batches)
    return _in_memory_eval_batches(
        getattr(data, f"{split}_x"), getattr(data, f"{split}_y"), data, batch_size, max_batches
    )


_eval_loaders: dict[str, Any] = {}  # one evaluation loader per process, kept while the same split is evaluated


def _eval_loader(test: Any, batch_size: int, num_workers: int, collate_fn: Any) -> DataLoader:
    """The test split's ``DataLoader``; with workers, one for the whole run (persistent workers),
    so an evaluation does not start its workers again."""
    if num_workers == 0:
        return DataLoader(test, batch_size=batch_size, collate_fn=collate_fn)
    key = (id(test), batch_size, num_workers, id(collate_fn))
    cached = _eval_loaders.get("loader")
    if cached is None or _eval_loaders.get("key") != key or cached.dataset is not test:
        cached = DataLoader(
            test,
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate_fn,
            persistent_workers=True,
            **worker_options(num_workers),
        )
        _eval_loaders.update(key=key, loader=cached)  # the one it replaces stops its workers
    return cached


def _in_memory_eval_batches(
    xs: Tensor, ys: Tensor, data: Dataset, batch_size: int, max_batches: int | None
) -> Iterator[Any]:
    if data.is_text:
        T = data.block_size
        n_windows = (xs.shape[0] - 1) // T
        starts = torch.arange(n_windows) * T
    else:
        n_windows = xs.shape[0]
    n_batches = -(-n_windows // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        lo, hi = b * batch_size, min((b + 1) * batch_size, n_windows)
        if data.is_text:
            windows = xs[starts[lo:hi, None] + torch.arange(T + 1)]
            yield windows[:, :-1], windows[:, 1:]
        else:
            yield xs[lo:hi], ys[lo:hi]
