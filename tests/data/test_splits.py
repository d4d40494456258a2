"""The validation split: held out of the training split by seed (data.val_fraction) or the data's own,
scored during training (val_*), watched by model selection; the test split scored once at the end."""

import pickle
from pathlib import Path

import pytest
import torch
from _paths import pythonpath_first
from torch.utils.data import TensorDataset

from fdp.data import Dataset, as_map_data, eval_batches, hold_out, load_stdlib_text, model_arguments
from fdp.errors import ConfigError
from fdp.run.build import build_data
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.report.metrics import read_metrics
from fdp.run.trainer import run

SMALL = ["model.hidden=16", "data.global_batch_size=16", "trainer.progress=false", "trainer.eval_batches=2"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# examples/my_project: a user's own model and map-style datasets, with a validation split of their own.
CUSTOM = [
    "trainer.progress=false",
    "model=custom",
    "model._target_=my_project.models.Net",
    "+model.width=16",
    "data=custom",
    "data._target_=my_project.data.make",
    "+data.n_train=300",
    "+data.n_test=64",
    "+data.n_val=40",
    "data.global_batch_size=16",
]


@pytest.fixture
def examples_on_path(monkeypatch):
    """examples/ importable here and in the workers, as ``PYTHONPATH=examples`` does from the shell."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", pythonpath_first(EXAMPLES))


def ids(n: int) -> Dataset:
    """In-memory data whose samples are their own indices."""
    return Dataset("ids", torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n), None, None, n)


def test_held_out_samples_leave_training_and_are_the_same_for_one_seed():
    n = 1000
    data = hold_out(ids(n), 0.1, seed=7, global_batch_size=64)
    train, val = data.train_y.tolist(), data.val_y.tolist()
    assert len(val) == 100 and not set(train) & set(val) and sorted(train + val) == list(range(n))
    assert torch.equal(data.val_x[:, 0].long(), data.val_y) and torch.equal(data.train_x[:, 0].long(), data.train_y)
    again = hold_out(ids(n), 0.1, seed=7, global_batch_size=64)
    assert torch.equal(again.val_y, data.val_y) and torch.equal(again.train_x, data.train_x)
    assert not torch.equal(hold_out(ids(n), 0.1, seed=8, global_batch_size=64).val_y, data.val_y)
    # Evaluation reads it as it reads the test split.
    assert torch.cat([y for _, y in eval_batches(data, 30, split="val")]).tolist() == val
    assert hold_out(ids(n), 0.0, seed=7, global_batch_size=64).val_x is None


def test_a_users_map_data_holds_out_the_same_indices_and_keeps_what_the_model_reads():
    n = 200
    train = TensorDataset(torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n) % 5)
    train.num_classes = 5
    data = hold_out(as_map_data("items", (train, None)), 0.25, seed=3, global_batch_size=8)
    kept, held = data.train.indices, data.val.indices
    assert len(held) == 50 and not set(kept) & set(held) and sorted(kept + held) == list(range(n))
    assert held == hold_out(ids(n), 0.25, seed=3, global_batch_size=8).val_y.tolist()  # the one rule for both kinds
    assert model_arguments(data)["num_classes"] == 5  # the split's own attributes still read
    assert pickle.loads(pickle.dumps(data.val)).indices == held  # DataLoader workers that spawn get it whole


def test_a_text_stream_holds_out_its_tail():
    text = load_stdlib_text(block_size=8, max_chars=5000)
    data = hold_out(text, 0.1, seed=0, global_batch_size=4)
    n = text.train_x.shape[0]
    assert torch.equal(torch.cat([data.train_x, data.val_x]), text.train_x) and data.val_x.shape[0] == n // 10


def test_val_fraction_is_refused_in_one_line_out_of_range_or_leaving_no_batch(tmp_path):
    for value in ("1.0", "-0.1", "1.5"):
        with pytest.raises(ConfigError) as error:
            validate(compose(f"data.val_fraction={value}"))
        assert str(error.value) == (
            f"data.val_fraction={float(value)}: expected a fraction in [0, 1) or null (0.1, or the data's own split)"
        )
    # 1438 training digits: 0.99 leaves 14, fewer than a batch of 16.
    with pytest.raises(
        ConfigError, match=r"^data.val_fraction=0.99: expected a part of the 1438 training samples"
    ) as e:
        run(compose(*SMALL, "data.val_fraction=0.99"), tmp_path / "big")
    assert "\n" not in str(e.value) and not (tmp_path / "big" / "metrics.jsonl").exists()


def _held_out(rank, world_size):
    data = build_data(compose("data.global_batch_size=16").data, seed=5)
    return data.val_y.tolist(), data.train_y.tolist()


def test_every_rank_holds_out_the_same_samples(run_ranks):
    results = run_ranks(_held_out)
    assert results[0] == results[1] == _held_out(0, 1)


def test_model_selection_watches_the_validation_split_and_the_test_split_is_scored_at_the_end(tmp_path):
    summary = run(
        compose(*SMALL, "trainer.max_steps=12", "trainer.eval_every=4", "trainer.log_every=3", "trainer.keep_best=1"),
        tmp_path,
    )
    steps, _ = read_metrics(tmp_path)
    assert [r["step"] for r in steps if "val_loss" in r] == [4, 8, 12]
    assert [r["step"] for r in steps if "test_loss" in r] == [12]
    assert {"val_loss", "val_acc", "test_loss", "test_acc"} <= set(summary)
    # The best checkpoint is ranked by val_loss, unless told otherwise.
    (best,) = (tmp_path / "checkpoints" / "best").iterdir()
    by_val = min((r["val_loss"], r["step"]) for r in steps if "val_loss" in r)
    assert best.name == f"step={by_val[1]}-val_loss={by_val[0]:.6g}.pt"


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            ["trainer.early_stopping.monitor=test_loss"],
            "trainer.early_stopping.monitor='test_loss': expected a metric of the validation split, val_loss",
        ),
        (
            ["data.val_fraction=0"],
            "trainer.early_stopping.monitor='val_loss': expected a metric of the test split, test_loss",
        ),
    ],
)
def test_a_monitor_of_a_split_not_scored_during_training_is_refused_before_step_1(tmp_path, settings, message):
    cfg = compose(*SMALL, "trainer.max_steps=4", "trainer.eval_every=2", "trainer.early_stopping.patience=1", *settings)
    with pytest.raises(ConfigError) as error:
        run(cfg, tmp_path)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert not (tmp_path / "metrics.jsonl").exists() and not list((tmp_path / "checkpoints").glob("*"))


def test_without_a_validation_split_evaluations_score_the_test_split(tmp_path):
    run(compose(*SMALL, "trainer.max_steps=4", "trainer.eval_every=2", "data.val_fraction=0"), tmp_path)
    steps, summary = read_metrics(tmp_path)
    assert [r["step"] for r in steps if "test_loss" in r] == [2, 4] and "val_loss" not in summary


def test_the_datas_own_validation_split_is_scored_and_nothing_is_held_out(tmp_path, examples_on_path):
    custom = [*CUSTOM, "trainer.max_steps=4", "trainer.eval_every=2"]
    data = build_data(compose(*custom).data, seed=0)
    assert len(data.train) == 300 and len(data.val) == 40 and len(data.test) == 64
    summary = run(compose(*custom), tmp_path / "own")
    assert {"val_loss", "test_loss"} <= set(summary)
    steps, _ = read_metrics(tmp_path / "own")
    assert [r["step"] for r in steps if "val_loss" in r] == [2, 4]
    with pytest.raises(ConfigError, match=r"^data.val_fraction=0.2: expected null for data with a validation split"):
        run(compose(*custom, "data.val_fraction=0.2"), tmp_path / "both")
