"""The built-in datasets, in memory and offline: scikit-learn's digits and the standard library's own text."""

from __future__ import annotations

import importlib.util
import os
import sysconfig
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import Tensor


class Dataset(NamedTuple):
    """An in-memory dataset.

    Classification: ``train_x``/``test_x`` are samples and ``train_y``/``test_y`` int64
    labels; ``block_size`` is ``None``.
    Text: ``train_x``/``test_x`` are 1-D int64 token streams and ``train_y``/``test_y``
    are the very same tensors (targets are the stream shifted by one, cut out per
    window); ``num_classes`` is the vocabulary size, ``vocab[i]`` the character of
    token ``i`` and ``block_size`` the window length T.
    ``targets_shifted`` says that a sample's targets are already its inputs shifted by
    one (the next tokens), so a loss that shifts them again (``loss=causal_lm``) would
    score each position against the token two ahead: ``fdp.model.fit`` refuses that pair.

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
    targets_shifted: bool = False
    val_x: Tensor | None = None  # the validation split, as the test split (fdp.data.splits)
    val_y: Tensor | None = None

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
_SPLIT, _EPOCH, _WINDOWS, _VALIDATION = 0, 1, 2, 3


def _generator(seed: int, tag: int, n: int) -> torch.Generator:
    # SeedSequence hashes (seed, tag, n) into well-mixed state; plain arithmetic like
    # seed*K + n would collide across (seed, epoch) pairs and correlate neighbours.
    words = [seed % 2**64, tag, n % 2**64]
    state = np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


def _check_fraction(test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction!r}: expected a fraction in (0, 1)")


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels (1797, 64) and labels, read from the file scikit-learn ships.

    Read directly: importing scikit-learn (with pandas, scipy) takes longer than the rest of a small
    run's start-up, and every rank of a local world pays it. Its own loader reads the same file the
    same way; it is the fallback where a release keeps the file elsewhere.
    """
    package = importlib.util.find_spec("sklearn")
    path = Path(package.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if package else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as _sk_load_digits

        raw = _sk_load_digits()
        return raw.data, raw.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


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
    _check_fraction(test_fraction)
    pixels, labels = _digits_arrays()
    x = torch.as_tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.as_tensor(labels, dtype=torch.int64)
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


def load_stdlib_text(
    block_size: int = 64, max_chars: int = 1_000_000, seed: int = 0, test_fraction: float = 0.1
) -> Dataset:
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
        raise ValueError(f"block_size={block_size!r}: expected an integer >= 1")
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
    return Dataset(
        "stdlib_text", train, train, test, test, len(vocab), block_size=block_size, vocab=vocab, targets_shifted=True
    )


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
