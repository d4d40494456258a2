import os
import sysconfig
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import IterableDataset, TensorDataset

from fdp.data import (
    STDLIB_TEXT_MODULES,
    Dataset,
    StepSampler,
    as_map_data,
    collate,
    eval_batches,
    global_batch,
    load_dataset,
    load_digits,
    load_stdlib_text,
    model_arguments,
    model_inputs,
    rank_share,
    split_micro_batches,
    train_batches,
)
from fdp.data.builtin import _digits_arrays, _digits_split

torch.set_num_threads(1)

TEXT_CHARS = 50_000


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_digits()


@pytest.fixture(scope="module")
def text() -> Dataset:
    return load_stdlib_text(block_size=16, max_chars=TEXT_CHARS)


def _toy(n: int) -> Dataset:
    # Labels equal indices, so a batch's labels say exactly which samples it holds.
    return Dataset("toy", torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n), None, None, n)


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _stdlib_source(max_chars: int) -> str:
    """The expected text, read independently of fdp.data."""
    root = sysconfig.get_paths()["stdlib"]
    chunks = []
    for module in STDLIB_TEXT_MODULES:
        path = os.path.join(root, module + ".py")
        if not os.path.exists(path):
            path = os.path.join(root, module, "__init__.py")
        with open(path, encoding="utf-8") as f:
            chunks.append(f.read())
    return "".join(chunks)[:max_chars]


# --- digits -------------------------------------------------------------------------------


def test_digits_shapes_and_dtypes(digits):
    assert digits.train_x.shape == (1438, 64) and digits.test_x.shape == (359, 64)
    assert digits.train_y.shape == (1438,) and digits.test_y.shape == (359,)
    assert digits.train_x.dtype == torch.float32 and digits.train_y.dtype == torch.int64
    assert digits.num_classes == 10 and not digits.is_text
    assert set(digits.train_y.tolist()) == set(range(10))
    images = load_digits(flatten=False)
    assert images.train_x.shape == (1438, 1, 8, 8)
    assert torch.equal(images.train_x.flatten(1), digits.train_x)
    assert load_digits(test_fraction=0.5).test_x.shape[0] == round(1797 * 0.5)


def test_digits_split_is_disjoint_and_standardised_with_train_statistics():
    from sklearn.datasets import load_digits as sk_load_digits

    raw = sk_load_digits()
    pixels, labels = _digits_arrays()  # the file read without importing scikit-learn: what its loader gives
    assert np.array_equal(pixels, raw.data) and np.array_equal(labels, raw.target) and labels.dtype == np.int64
    x = torch.as_tensor(raw.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(raw.target)
    data = load_digits(seed=3)
    train_idx, test_idx = _digits_split(1797, 359, 3)
    assert len(train_idx) == 1438 and len(test_idx) == 359
    assert not set(train_idx.tolist()) & set(test_idx.tolist())
    assert sorted(train_idx.tolist() + test_idx.tolist()) == list(range(1797))

    mean, std = x[train_idx].mean(0), x[train_idx].std(0)
    std[std == 0] = 1.0
    torch.testing.assert_close(data.train_x, (x[train_idx] - mean) / std)
    torch.testing.assert_close(data.test_x, (x[test_idx] - mean) / std)
    assert torch.equal(data.train_y, y[train_idx]) and torch.equal(data.test_y, y[test_idx])
    varying = x[train_idx].std(0) > 0
    torch.testing.assert_close(data.train_x.mean(0), torch.zeros(64), atol=1e-5, rtol=0)
    torch.testing.assert_close(data.train_x.std(0)[varying], torch.ones(int(varying.sum())), atol=1e-5, rtol=0)


def test_digits_deterministic_and_seed_dependent(digits):
    again = load_digits()
    assert _equal(digits[1:5], again[1:5])
    assert not torch.equal(load_digits(seed=1).train_y, digits.train_y)


def test_digits_bad_fraction():
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=1.0)


# --- global_batch: classification ------------------------------------------------------------


def test_global_batch_is_deterministic(digits):
    a = global_batch(digits, 7, 64, seed=5)
    b = global_batch(digits, 7, 64, seed=5)
    assert _equal(a, b)
    assert a[0].shape == (64, 64) and a[1].shape == (64,)
    assert not torch.equal(global_batch(digits, 7, 64, seed=6)[1], a[1])
    assert not torch.equal(global_batch(digits, 8, 64, seed=5)[1], a[1])


def test_one_epoch_visits_every_digit_exactly_once(digits):
    # 1438 = 2 * 719: two steps are one epoch.
    xs = torch.cat([global_batch(digits, s, 719, seed=0)[0] for s in range(2)])
    assert xs.shape == digits.train_x.shape
    assert sorted(map(tuple, xs.tolist())) == sorted(map(tuple, digits.train_x.tolist()))  # same multiset of rows


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), batch=st.integers(1, 40), seed=st.integers(0, 2**40), epochs=st.integers(1, 3))
def test_epoch_semantics(n, batch, seed, epochs):
    batch = min(batch, n)
    data = _toy(n)
    steps = -(-epochs * n // batch)
    stream = torch.cat([global_batch(data, s, batch, seed)[1] for s in range(steps)])
    assert len(stream) == steps * batch
    # Each epoch is a permutation: wrap into the next epoch, never drop nor repeat within one.
    for e in range(len(stream) // n):
        assert sorted(stream[e * n : (e + 1) * n].tolist()) == list(range(n))
    leftover = stream[(len(stream) // n) * n :].tolist()
    assert len(set(leftover)) == len(leftover)


def test_epochs_use_different_permutations():
    data = _toy(50)
    epoch0 = global_batch(data, 0, 50, seed=0)[1]
    epoch1 = global_batch(data, 1, 50, seed=0)[1]
    assert sorted(epoch1.tolist()) == list(range(50))
    assert not torch.equal(epoch0, epoch1)


@pytest.mark.parametrize("k", [0, 3, 17])
def test_resumption_reproduces_the_uninterrupted_run(k, digits):
    torch.manual_seed(0)
    uninterrupted = [global_batch(digits, s, 100, seed=9) for s in range(k + 1)]
    torch.manual_seed(1)  # a resumed process has a different global RNG state
    resumed = global_batch(digits, k, 100, seed=9)
    assert _equal(uninterrupted[k], resumed)


def test_global_rng_untouched(digits, text):
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    global_batch(digits, 3, 32, seed=0)
    global_batch(text, 3, 32, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_global_batch_size_validation(digits, text):
    for bad in (0, -4):
        with pytest.raises(ValueError, match=r"data\.global_batch_size"):
            global_batch(digits, 0, bad, seed=0)
        with pytest.raises(ValueError, match=r"data\.global_batch_size"):
            global_batch(text, 0, bad, seed=0)
    with pytest.raises(ValueError, match=r"data\.global_batch_size=1439.*more samples per step.*1438"):
        global_batch(digits, 0, 1439, seed=0)
    assert global_batch(digits, 0, 1438, seed=0)[0].shape[0] == 1438
    x, y = global_batch(text, 0, 2 * TEXT_CHARS, seed=0)  # more windows than exist: allowed for text
    assert x.shape == (2 * TEXT_CHARS, 16)


# --- shares / micro-batches ---------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_shares_concatenate_to_the_global_batch(world_size, digits, text):
    for data in (digits, text):
        batch = global_batch(data, 2, 64, seed=1)
        shares = [rank_share(batch, r, world_size) for r in range(world_size)]
        assert all(s[0].shape[0] == 64 // world_size for s in shares)
        assert _equal(tuple(torch.cat(parts) for parts in zip(*shares)), batch)


def test_share_errors_name_the_setting(digits):
    batch = global_batch(digits, 0, 30, seed=0)
    with pytest.raises(ValueError, match=r"data\.global_batch_size=30.*world size 4"):
        rank_share(batch, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        rank_share(batch, 3, 3)
    with pytest.raises(ValueError, match="batch dimension"):
        rank_share((torch.zeros(4), torch.zeros(6)), 0, 2)


def test_micro_batches_concatenate_to_the_share(digits):
    batch = rank_share(global_batch(digits, 0, 48, seed=0), 1, 2)
    micro = split_micro_batches(batch, 3)
    assert len(micro) == 3 and all(m[0].shape[0] == 8 for m in micro)
    assert _equal(tuple(torch.cat(parts) for parts in zip(*micro)), batch)
    assert _equal(split_micro_batches(batch, 1)[0], batch)
    with pytest.raises(ValueError, match=r"^accum_steps=5: expected a divisor of the per-rank batch of 24 samples$"):
        split_micro_batches(batch, 5)
    with pytest.raises(ValueError, match=r"^accum_steps=0: expected an integer >= 1$"):
        split_micro_batches(batch, 0)


# --- stdlib text --------------------------------------------------------------------------


def test_stdlib_text_matches_the_sources_and_vocabulary_covers_it(text):
    expected = _stdlib_source(TEXT_CHARS)
    assert len(expected) == TEXT_CHARS
    assert text.vocab == "".join(sorted(set(expected))) and text.num_classes == len(text.vocab)
    assert text.decode(text.train_x) + text.decode(text.test_x) == expected
    assert text.train_x.dtype == torch.int64
    assert int(text.train_x.max()) < text.num_classes and int(text.train_x.min()) >= 0
    assert text.train_x.shape[0] == 45_000 and text.test_x.shape[0] == 5_000  # last 10% by position
    assert text.train_y is text.train_x  # streams are stored once, not materialised windows


def test_stdlib_text_is_the_same_twice(text):
    again = load_stdlib_text(block_size=16, max_chars=TEXT_CHARS)
    assert again.vocab == text.vocab
    assert torch.equal(again.train_x, text.train_x) and torch.equal(again.test_x, text.test_x)
    prefix = load_stdlib_text(max_chars=1000)
    assert prefix.decode(prefix.train_x) == text.decode(text.train_x[:900])


def test_text_windows_are_shifted_by_one(text):
    x, y = global_batch(text, 4, 32, seed=3)
    assert x.shape == y.shape == (32, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    train_text = text.decode(text.train_x)
    for row_x, row_y in zip(x[:4], y[:4]):
        window = text.decode(row_x) + text.decode(row_y[-1:])
        assert window in train_text


def test_text_batches_depend_on_seed_and_step(text):
    a = global_batch(text, 4, 32, seed=3)
    assert _equal(a, global_batch(text, 4, 32, seed=3))
    assert not torch.equal(a[0], global_batch(text, 5, 32, seed=3)[0])
    assert not torch.equal(a[0], global_batch(text, 4, 32, seed=4)[0])


def test_text_windows_reach_both_ends_of_the_stream():
    data = load_stdlib_text(block_size=4, max_chars=100)  # 90 train chars: offsets 0..85
    x, y = global_batch(data, 0, 5000, seed=0)
    starts = {data.decode(r) for r in x}
    assert data.decode(data.train_x[:4]) in starts
    assert data.decode(data.train_x[-5:-1]) in starts
    ends = {data.decode(r) for r in y}
    assert data.decode(data.train_x[-4:]) in ends


def test_load_stdlib_text_is_fast():
    timings = []
    for _ in range(2):
        start = time.perf_counter()
        data = load_stdlib_text()
        timings.append(time.perf_counter() - start)
    assert data.train_x.shape[0] + data.test_x.shape[0] == 1_000_000
    assert min(timings) < 1.0, timings


def test_stdlib_text_too_short():
    with pytest.raises(ValueError, match="block_size"):
        load_stdlib_text(block_size=64, max_chars=200)


# --- eval --------------------------------------------------------------------------------


def test_eval_batches_digits_in_order(digits):
    batches = list(eval_batches(digits, 100))
    assert [len(y) for _, y in batches] == [100, 100, 100, 59]
    assert torch.equal(torch.cat([x for x, _ in batches]), digits.test_x)
    assert torch.equal(torch.cat([y for _, y in batches]), digits.test_y)
    assert len(list(eval_batches(digits, 100, max_batches=2))) == 2
    assert _equal(next(eval_batches(digits, 100)), batches[0])


def test_eval_batches_text_non_overlapping(text):
    batches = list(eval_batches(text, 64))
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    n = (5_000 - 1) // 16
    assert x.shape == y.shape == (n, 16)
    assert torch.equal(x.flatten(), text.test_x[: n * 16])
    assert torch.equal(y.flatten(), text.test_x[1 : n * 16 + 1])
    assert len(list(eval_batches(text, 64, max_batches=1))) == 1


def test_eval_batches_needs_a_test_split():
    with pytest.raises(ValueError, match="no test split"):
        next(eval_batches(_toy(4), 2))


# --- registry ------------------------------------------------------------------------------


def test_load_dataset(digits):
    assert _equal(load_dataset("digits")[1:5], digits[1:5])
    data = load_dataset("stdlib_text", block_size=8, max_chars=2000)
    assert data.name == "stdlib_text" and data.block_size == 8
    with pytest.raises(ValueError, match="known datasets: digits, stdlib_text"):
        load_dataset("mnist")


# --- a user's map-style datasets ---------------------------------------------------------------


class _Items(torch.utils.data.Dataset):
    """Items as a user might write them: a tensor input and a Python number target."""

    def __init__(self, n, real=False):
        self.n, self.real = n, real

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3,), float(i)), (i / 2 if self.real else i)


@pytest.mark.parametrize("world_size", [2, 4])
def test_step_sampler_ranks_read_the_global_batch_of_one_process_in_order(world_size):
    n, size, steps = 37, 12, 9  # batches cross epoch boundaries
    one = list(StepSampler(n, size, seed=3, stop_step=steps))
    ranks = [
        list(StepSampler(n, size, seed=3, rank=r, world_size=world_size, stop_step=steps)) for r in range(world_size)
    ]
    for step in range(steps):
        assert sum((ranks[r][step] for r in range(world_size)), []) == one[step]
    # Each epoch is a permutation of all samples, and the order is the in-memory path's.
    stream = sum(one, [])
    assert sorted(stream[:n]) == list(range(n)) and sorted(stream[n : 2 * n]) == list(range(n))
    toy = _toy(n)
    assert [global_batch(toy, s, size, seed=3)[1].tolist() for s in range(steps)] == one


def test_step_sampler_resumes_at_the_exact_sample():
    uninterrupted = list(StepSampler(50, 16, seed=1, rank=1, world_size=2, stop_step=10))
    assert list(StepSampler(50, 16, seed=1, rank=1, world_size=2, start_step=7, stop_step=10)) == uninterrupted[7:]
    assert len(StepSampler(50, 16, seed=1, start_step=7, stop_step=10)) == 3
    with pytest.raises(ValueError, match="global_batch_size=51: expected between 1 and the 50 training samples"):
        StepSampler(50, 51, seed=0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_batches_equal_the_in_memory_path(digits, num_workers):
    """Digits as a map-style Dataset through a DataLoader: the batches of global_batch + rank_share, on every rank."""
    items = as_map_data("digits", (TensorDataset(digits.train_x, digits.train_y), None))
    for rank in range(2):
        fast = list(train_batches(digits, 32, 5, rank, 2, start_step=40, stop_step=47))
        loaded = list(train_batches(items, 32, 5, rank, 2, start_step=40, stop_step=47, num_workers=num_workers))
        assert len(loaded) == 7 and all(_equal(a, b) for a, b in zip(fast, loaded))


def test_collate_gives_default_dtypes_for_python_numbers():
    x, y = collate([_Items(4)[i] for i in range(4)])
    assert x.shape == (4, 3) and x.dtype == torch.float32 and y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 3]
    assert collate([_Items(4, real=True)[3]])[1].dtype == torch.float32


class _Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), 0


class _Unsized(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return torch.zeros(2), 0


class _Triples(_Items):
    def __getitem__(self, i):
        return torch.zeros(2), 0, 1


class _Strings(_Items):
    def __getitem__(self, i):
        return "a picture", 0


class _Tokens(torch.utils.data.Dataset):
    """Items as a tokenizer makes them: ids of different lengths, labels the same ids (or no labels)."""

    def __init__(self, n, labels=True):
        self.n, self.labels = n, labels

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = list(range(i, i + 1 + i % 4))
        return {"input_ids": ids, **({"labels": ids} if self.labels else {})}


def _pad_collate(items):
    """A collator of one's own (as Hugging Face's): pads to the longest item, -100 in the labels' padding.

    Returns a UserDict, as Hugging Face's BatchEncoding is one.
    """
    from collections import UserDict

    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.tensor([item["input_ids"] + [0] * (longest - len(item["input_ids"])) for item in items])
    mask = torch.tensor([[1] * len(item["input_ids"]) + [0] * (longest - len(item["input_ids"])) for item in items])
    out = UserDict(input_ids=ids, attention_mask=mask)
    if "labels" in items[0]:
        out["labels"] = torch.where(mask.bool(), ids, -100)
    return out


@pytest.mark.parametrize(
    "splits,message",
    [
        (
            _Items(3),
            r"^returned a _Items; expected \(train, test\) or \(train, test, collate\): map-style torch Datasets "
            r"\(test may be None\)",
        ),
        ((_Items(3),), r"^returned a tuple of 1 items; expected \(train, test\)"),
        ((_Stream(), None), r"^the train split is a _Stream; expected a map-style torch Dataset \(items by index\)$"),
        (
            (_Unsized(), None),
            r"^the train split \(_Unsized\) has no len\(\); expected a map-style Dataset with __len__$",
        ),
        ((_Items(0), None), r"^the train split is empty$"),
        (
            (_Triples(3), None),
            r"^train item 0 is a 3-tuple; expected a pair \(input, target\) or a dict with a 'labels' entry$",
        ),
        ((_Items(3), _Strings(3)), r"^test item 0: its input is a str; expected a tensor, a number or an array$"),
        (
            (_Tokens(3, labels=False), None),
            r"^train item 0 is a dict with entries \['input_ids'\]; expected a 'labels' entry \(the target\)$",
        ),
        (
            (_Tokens(3, labels=False), None, _pad_collate),
            r"^train item 0 does not make a batch: a dict batch with entries \['attention_mask', 'input_ids'\] "
            r"has no 'labels' entry",
        ),
        (
            (_Tokens(3), None),
            r"^train item 0: its input_ids is a list; expected a tensor, a number or an array \(or return \(train, "
            r"test, collate\) with a function that pads them, such as a Hugging Face data collator\)$",
        ),
        (
            (_Tokens(3), None, "pad"),
            r"^returned a str as the collate function; expected a function from a list of items to a batch$",
        ),
    ],
)
def test_map_data_refuses_what_is_not_a_pair_of_map_style_datasets(splits, message):
    with pytest.raises(ValueError, match=message):
        as_map_data("mine", splits)


def test_model_arguments_come_from_the_items_and_the_dataset():
    data = as_map_data("mine", (_Items(5), None))
    args = model_arguments(data)
    assert (args["in_features"], args["in_channels"], args["num_classes"], args["out_features"]) == (3, 1, None, None)
    train = TensorDataset(torch.zeros(5, 2, 4, 4), torch.zeros(5, dtype=torch.int64))
    train.classes = ["cat", "dog"]  # torchvision's convention
    args = model_arguments(as_map_data("mine", (train, None)))
    assert (args["in_features"], args["in_channels"], args["num_classes"], args["out_features"]) == (32, 2, 2, 2)
    args = model_arguments(as_map_data("mine", (TensorDataset(torch.zeros(5, 3), torch.zeros(5, 2)), None)))
    assert args["out_features"] == 2 and args["num_classes"] is None


# --- dict batches: Hugging Face's convention ------------------------------------------------------


def test_dict_batches_share_out_and_split_along_the_batch_dimension_like_pairs():
    batch = {"input_ids": torch.arange(24).reshape(8, 3), "attention_mask": torch.ones(8, 3), "labels": torch.arange(8)}
    pair = ({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, batch["labels"])
    for world_size in (1, 2, 4):
        shares = [rank_share(batch, r, world_size) for r in range(world_size)]
        assert all(sorted(s) == sorted(batch) for s in shares)
        for key in batch:
            assert torch.equal(torch.cat([s[key] for s in shares]), batch[key])
        paired = [rank_share(pair, r, world_size) for r in range(world_size)]
        assert all(
            torch.equal(p[1], s["labels"]) and torch.equal(p[0]["input_ids"], s["input_ids"])
            for p, s in zip(paired, shares)
        )
    micro = split_micro_batches(shares[1], 2)
    assert [m["labels"].tolist() for m in micro] == [[2], [3]]
    args, kwargs, targets = model_inputs(micro[0])
    assert args == () and sorted(kwargs) == ["attention_mask", "input_ids"] and targets.tolist() == [2]
    with pytest.raises(
        ValueError,
        match=r"batch tensors disagree on the batch dimension: input_ids \(8, 3\) int64, labels \(7,\) int64",
    ):
        split_micro_batches({"input_ids": batch["input_ids"], "labels": batch["labels"][:7]}, 1)
    with pytest.raises(ValueError, match=r"^a dict batch with entries \['input_ids'\] has no 'labels' entry"):
        model_inputs({"input_ids": batch["input_ids"]})


def test_a_batch_encoding_from_a_collator_splits_as_a_dict():
    encoded = _pad_collate([_Tokens(4)[i] for i in range(4)])
    assert not isinstance(encoded, dict)  # a UserDict: one leaf to torch's pytree functions
    micro = split_micro_batches(encoded, 2)
    assert type(micro[0]) is dict and torch.equal(micro[1]["labels"], encoded["labels"][2:])


def test_dict_items_with_their_own_collate_are_read_in_the_global_batch_order_on_any_world_size():
    """Each rank pads its own share; the real tokens of the ranks' shares are those of the one-process batch."""
    data = as_map_data("tokens", (_Tokens(37), _Tokens(5), _pad_collate))
    assert model_arguments(data)["in_features"] == 1  # the first input entry (input_ids) of item 0
    for step in (0, 5):  # 5 crosses an epoch boundary
        (one,) = train_batches(data, 12, 3, 0, 1, step, step + 1)
        shares = [next(train_batches(data, 12, 3, r, 3, step, step + 1, num_workers=r % 2)) for r in range(3)]

        def real(b):
            return [row[m.bool()].tolist() for row, m in zip(b["input_ids"], b["attention_mask"])]

        assert sum((real(s) for s in shares), []) == real(one)
        assert all(type(s) is dict and (s["labels"] == -100).sum() == (s["attention_mask"] == 0).sum() for s in shares)
    (test,) = eval_batches(data, batch_size=8)
    assert sorted(test) == ["attention_mask", "input_ids", "labels"] and test["input_ids"].shape == (5, 4)


def test_fdp_collate_stacks_dict_items_of_equal_length():
    items = [{"input_ids": torch.arange(3) + i, "labels": i} for i in range(4)]
    data = as_map_data("fixed", (items, None))
    batch = next(train_batches(data, 4, 0, 0, 1, 0, 1))
    assert batch["input_ids"].shape == (4, 3) and batch["labels"].dtype == torch.int64


# -- loader workers in a rank of a local world ----------------------------------------------------
MARK = {"value": 0}  # set at run time in the rank: a forked worker sees it, a spawned one re-imports 0


class WhoLoads(torch.utils.data.Dataset):
    """Items that say which process loaded them, and what it saw of the rank's ``MARK``."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([os.getpid(), MARK["value"]]), 0


def _loader_workers(rank, world):
    MARK["value"] = 7
    data = as_map_data("who", (WhoLoads(), WhoLoads()))
    x, _ = next(train_batches(data, 16, 0, rank, world, 0, 1, num_workers=2))
    evaluations = [
        {int(p) for x, _ in eval_batches(data, 8, max_batches=4, num_workers=2) for p in x[:, 0]} for _ in range(3)
    ]
    return x[:, 1].tolist(), evaluations


def test_loader_workers_of_a_rank_are_forked_and_evaluation_keeps_its_workers(run_ranks):
    """A rank started by spawn would give its DataLoader spawned workers (each re-imports torch:
    seconds per loader); they are forked, and every evaluation reuses the one test loader's workers."""
    for marks, evaluations in run_ranks(_loader_workers):
        assert set(marks) == {7}  # forked: the workers saw the rank's own state
        assert len(evaluations[0]) == 2 and evaluations[0] == evaluations[1] == evaluations[2]
        assert os.getpid() not in evaluations[0]
