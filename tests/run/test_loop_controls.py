"""Loop controls: max_epochs, max_time, early stopping, the best checkpoints and the moving average,
on one rank and two, stopped and resumed."""

import json
import math
import time
from pathlib import Path

import pytest
import torch
from _saved import saved
from torch.utils.data import TensorDataset

from fdp.comm import Comm
from fdp.data import StepSampler, as_map_data, load_digits
from fdp.errors import ConfigError
from fdp.run.checkpoint import last_of
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.loop_controls import Deadline, run_steps
from fdp.run.monitor import Monitor, Stopping, ranked, stopping_update
from fdp.run.report.metrics import read_metrics
from fdp.run.rundir import RankStatus
from fdp.run.trainer import run

SMALL = [
    "model=mlp",
    "model.hidden=32",
    "trainer.progress=false",
    "data.global_batch_size=16",
    "trainer.bucket_cap_mb=0.01",
    "trainer.first_bucket_cap_mb=0.005",
    "trainer.eval_batches=2",
]


def checkpoint(run_dir, name=None):
    checkpoints = Path(run_dir) / "checkpoints"
    return saved(checkpoints if name is None else checkpoints / name)


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- the values, alone ---------------------------------------------------------------------------
def test_max_epochs_counts_passes_over_the_training_data():
    # Each step reads global_batch_size samples of one permutation per pass: E passes end with the step
    # that reads the last sample of pass E, and every sample is read exactly E times by then.
    n, size, epochs = 300, 32, 3
    steps = math.ceil(epochs * n / size)
    assert run_steps(10_000, epochs, _items(n), size) == steps == 29
    read = [i for batch in StepSampler(n, size, seed=0, stop_step=steps) for i in batch]
    assert sorted(read[: epochs * n]) == sorted(list(range(n)) * epochs)
    assert len(read) - epochs * n < size  # the last step only fills up from pass E + 1
    assert run_steps(20, epochs, _items(n), size) == 20  # max_steps still caps it
    assert run_steps(300, 0, _items(n), size) == 300  # off
    assert run_steps(300, 1, load_digits(), 64) == math.ceil(1438 / 64)


def _items(n):
    return as_map_data("items", (TensorDataset(torch.zeros(n, 2), torch.zeros(n, dtype=torch.long)), None))


def test_early_stopping_counts_evaluations_since_the_best_and_resets_on_improvement():
    monitor = Monitor.of("test_loss", min_delta=0.01)
    state, waits = Stopping(), []
    for value in (1.0, 0.8, 0.805, 0.795, 0.7, float("nan"), 0.71, 0.72):
        state = stopping_update(state, value, monitor)
        waits.append(state.waited)
    assert waits == [0, 0, 1, 2, 0, 1, 2, 3] and state.best == 0.7  # 0.795 is within min_delta; NaN never improves
    accuracy = Monitor.of("test_acc")
    assert accuracy.mode == "max" and stopping_update(Stopping(0.5, 2), 0.6, accuracy) == Stopping(0.6, 0)


def test_best_checkpoints_rank_by_the_metric_and_keep_k():
    best, admitted = (), []
    for step, value in enumerate((0.9, 0.5, 0.7, 0.95, 0.4, 0.5), start=1):
        best, kept = ranked(best, value, step, 3, Monitor.of("test_loss"))
        admitted.append(kept)
    assert best == ((0.4, 5), (0.5, 2), (0.5, 6)) and admitted == [True, True, True, False, True, True]
    high, _ = ranked(((0.9, 1),), 0.95, 2, 2, Monitor.of("test_acc"))
    assert high == ((0.95, 2), (0.9, 1))


def test_settings_are_refused_in_one_line_each():
    for override, message in [
        ("trainer.early_stopping.patience=-1", "trainer.early_stopping.patience=-1: expected an integer >= 0"),
        ("trainer.max_time=1h", "trainer.max_time='1h': expected seconds >= 0 or DD:HH:MM:SS"),
        ("trainer.ema_decay=1.0", "trainer.ema_decay=1.0: expected 0 (off) or a decay in (0, 1)"),
        ("trainer.max_epochs=-1", "trainer.max_epochs=-1: expected an integer >= 0"),
        ("trainer.keep_best=-1", "trainer.keep_best=-1: expected an integer >= 0"),
        # A metric named for what is off would do nothing: refused, not ignored.
        ("trainer.checkpoint_monitor=val_acc", "trainer.checkpoint_monitor='val_acc': expected trainer.keep_best >= 1"),
        (
            "trainer.early_stopping.monitor=val_acc",
            "trainer.early_stopping.monitor='val_acc': expected trainer.early_stopping.patience >= 1",
        ),
        ("trainer.early_stopping.monitor=", "trainer.early_stopping.monitor='': expected a metric of the evaluations"),
        ("trainer.checkpoint_mode=up", "trainer.checkpoint_mode='up': expected auto, min or max"),
        ("trainer.loggers=[comet]", "trainer.loggers=['comet']: expected a list of tensorboard, csv, mlflow, wandb"),
    ]:
        with pytest.raises(ConfigError) as error:
            validate(compose(override))
        assert str(error.value).startswith(message) and "\n" not in str(error.value), override
    with pytest.raises(ConfigError, match=r"early_stopping.patience=3: expected 0 with trainer.eval_every=0"):
        validate(compose("trainer.early_stopping.patience=3", "trainer.eval_every=0"))


def test_a_monitor_the_evaluations_lack_is_refused_naming_the_metrics_they_have(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"trainer.checkpoint_monitor=.val_los.: expected a metric of the evaluations: val_loss, val_acc or loss$",
    ):
        run(
            compose(
                *SMALL,
                "trainer.max_steps=2",
                "trainer.eval_every=2",
                "trainer.checkpoint_monitor=val_los",
                "trainer.keep_best=1",
            ),
            tmp_path,
        )


# -- max_time: rank 0's clock, every rank's step ------------------------------------------------------
def _deadline_steps(rank, world_size):
    # Only rank 0's clock counts (rank 1's limit would have run out at once): both stop after the same step.
    deadline = Deadline(0.3 if rank == 0 else 1e-9, 0.0, Comm())
    for step in range(1, 10_000):
        time.sleep(0.01)
        if deadline.passed():
            deadline.close()
            return step
    deadline.close()
    return None


def test_max_time_stops_every_rank_after_the_same_step(run_ranks):
    steps = run_ranks(_deadline_steps)
    assert steps[0] is not None and steps[0] == steps[1]


def test_max_time_stops_two_ranks_at_one_step_with_a_checkpoint_and_counts_across_resumes(tmp_path):
    summary = run(
        compose(
            *SMALL,
            "world=local2",
            "trainer.max_steps=100000",
            "trainer.max_time=3",
            "trainer.log_every=1000",
            "trainer.checkpoint_every=0",
        ),
        tmp_path,
    )
    steps = summary["steps"]
    assert summary["stopped"] == "max_time" and 1 <= steps < 100000
    assert checkpoint(tmp_path)["step"] == steps and 3.0 <= checkpoint(tmp_path)["loop"]["elapsed_s"] < 60
    assert RankStatus.read(tmp_path, 0)["step"] == RankStatus.read(tmp_path, 1)["step"] == steps
    # Resumed (here on one process): the time is spent already, so the run ends at once where it was.
    again = run(
        compose(
            *SMALL,
            "trainer.max_steps=100000",
            "trainer.max_time=3",
            "trainer.resume=true",
            "trainer.log_every=1000",
            "trainer.checkpoint_every=0",
        ),
        tmp_path,
    )
    assert again["steps"] == steps and again["stopped"] == "max_time"


# -- early stopping, the best checkpoints and the average on two ranks ---------------------------------
CONTROLS = [
    *SMALL,
    "trainer.max_steps=12",
    "trainer.eval_every=2",
    "trainer.log_every=2",
    "trainer.ema_decay=0.8",
    # min_delta so large that no evaluation after the first improves: the run stops at the third (step 6)
    "trainer.early_stopping.patience=2",  # of val_loss, the default
    "trainer.early_stopping.min_delta=100",
    "trainer.checkpoint_monitor=ema_val_loss",
    "trainer.keep_best=2",
    "trainer.loggers=[csv]",
]


def test_two_ranks_at_stage_3_stopped_and_resumed_end_like_one_process_uninterrupted(tmp_path):
    """Early stopping, the best checkpoints and the moving average (kept per slice at ZeRO stage 3) on
    two ranks, stopped at step 5 and resumed, equal one process's uninterrupted run on the union batch."""
    one = run(compose(*CONTROLS), tmp_path / "one")
    run(compose(*CONTROLS, "world=local2", "trainer.zero_stage=3", "trainer.stop_at=5"), tmp_path / "two")
    two = run(compose(*CONTROLS, "world=local2", "trainer.zero_stage=3", "trainer.resume=true"), tmp_path / "two")
    assert one["steps"] == two["steps"] == 6 and one["stopped"] == two["stopped"] == "early_stopping"
    assert RankStatus.read(tmp_path / "two", 0)["step"] == RankStatus.read(tmp_path / "two", 1)["step"] == 6
    a, b = checkpoint(tmp_path / "one"), checkpoint(tmp_path / "two")
    assert a["step"] == b["step"] == 6
    assert max_diff(a["params"], b["params"]) <= 1e-5
    assert max_diff(a["ema"], b["ema"]) <= 1e-5
    assert max_diff(a["ema"], a["params"]) > 1e-3  # an average, not the params
    assert b["loop"]["stopping_waited"] == 2 and len(b["loop"]["best"]) == 2
    assert abs(one["ema_val_loss"] - two["ema_val_loss"]) <= 1e-4
    # The test split, scored once at the end of the run it stopped early, alike on both.
    assert abs(one["ema_test_loss"] - two["ema_test_loss"]) <= 1e-4 and abs(one["test_loss"] - two["test_loss"]) <= 1e-4
    # The two best by ema_val_loss, the same steps on both, each a whole checkpoint of its step.
    names = [
        sorted(p.name for p in (tmp_path / run_dir / "checkpoints" / "best").iterdir()) for run_dir in ("one", "two")
    ]
    steps = [int(name.split("-")[0].removeprefix("step=")) for name in names[0]]
    assert [n.split("-")[0] for n in names[0]] == [n.split("-")[0] for n in names[1]] and len(steps) == 2
    records = {r["step"]: r for r in read_metrics(tmp_path / "one")[0] if "loss" in r}
    best = sorted(records[s]["ema_val_loss"] for s in (2, 4, 6))[:2]
    assert sorted(records[s]["ema_val_loss"] for s in steps) == best
    # Model selection saw the validation split only: no test figure before the end.
    assert [r["step"] for r in read_metrics(tmp_path / "one")[0] if "test_loss" in r] == [6]
    for name, step in zip(names[1], steps):
        assert checkpoint(tmp_path / "two", f"best/{name}")["step"] == step
    # The CSV file has a row per logged step of both invocations, the evaluations' columns included.
    rows = (tmp_path / "two" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss,") and "ema_val_loss" in rows[0].split(",")
    # Step 5 closed the first invocation; the second row of step 6 is the test split's, scored at the end.
    assert [int(r.split(",")[0]) for r in rows[1:]] == [2, 4, 5, 6, 6]


def test_sharded_best_checkpoints_are_step_directories_of_links_and_resume(tmp_path):
    """In the sharded format the best checkpoints are their steps' directories, hard-linked (no bytes copied),
    kept after the step directories are pruned, and each resumes as its step."""
    sharded = [*SMALL, "world=local2", "trainer.zero_stage=2", "trainer.checkpoint_format=sharded"]
    best = ["trainer.max_steps=8", "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=1"]
    run(compose(*sharded, *best, "trainer.keep_best=2"), tmp_path / "a")
    kept = sorted((tmp_path / "a" / "checkpoints" / "best").iterdir())
    records = {r["step"]: r["val_loss"] for r in read_metrics(tmp_path / "a")[0] if "val_loss" in r}
    steps = sorted(records, key=records.get)[:2]
    assert [int(p.name.split("-")[0].removeprefix("step=")) for p in kept] == sorted(steps)
    assert all(p.is_dir() and (p / "fdp.pt").is_file() and (p / ".metadata").is_file() for p in kept)
    newest = last_of(tmp_path / "a" / "checkpoints")
    for p in kept:  # the step still on disk shares its files' inodes with its best copy
        if p.name.startswith(f"step={int(newest.name.removeprefix('step_'))}-"):
            assert (p / "fdp.pt").stat().st_ino == (newest / "fdp.pt").stat().st_ino
    first = kept[0]
    resumed = run(compose(*sharded, *best, "trainer.keep_best=0", f"trainer.resume='{first}'"), tmp_path / "b")
    assert resumed["steps"] == 8 and read_metrics(tmp_path / "b")[0][0]["step"] > int(first.name.split("-")[0][5:])


def test_max_epochs_sets_the_run_and_its_schedule_from_the_shell_settings(tmp_path):
    # Checkpoints at steps 4 and 8 come before the one evaluation (at the end), which alone ranks.
    summary = run(
        compose(
            *SMALL,
            "data.global_batch_size=128",
            "trainer.max_epochs=1",
            "trainer.log_every=1",
            "trainer.eval_every=0",
            "optim.lr_schedule=warmup_cosine",
            "optim.warmup_steps=0",
            "trainer.checkpoint_every=4",
            "trainer.checkpoint_monitor=val_acc",
            "trainer.keep_best=1",
        ),
        tmp_path,
    )
    assert summary["steps"] == math.ceil(1294 / 128) == 11  # 1438 training digits, 144 of them held out
    assert [p.name for p in (tmp_path / "checkpoints" / "best").iterdir()] == [
        f"step=11-val_acc={summary['val_acc']:.6g}.pt"
    ]
    lrs = [r["lr"] for r in read_metrics(tmp_path)[0]]
    assert lrs[0] > 0.09 and lrs[-1] < 0.01  # the cosine decays over these 11 steps, not over max_steps=300
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["steps"] == 11


def test_early_stopping_counts_every_evaluation_whatever_log_every_is(tmp_path):
    # Evaluations every 8 steps with the default log_every=10: patience=1 with a min_delta no evaluation meets
    # stops at the second evaluation, step 16 (not at step 80, the second multiple of both). Early stopping
    # watches val_loss unless told.
    summary = run(
        compose(
            *SMALL,
            "trainer.max_steps=200",
            "trainer.eval_every=8",
            "trainer.early_stopping.min_delta=10",
            "trainer.early_stopping.patience=1",
        ),
        tmp_path,
    )
    assert summary["steps"] == 16 and summary["stopped"] == "early_stopping"
    assert [r["step"] for r in read_metrics(tmp_path)[0] if "val_loss" in r] == [8, 16]
    assert (tmp_path / "train.log").read_text().count("early stopping: val_loss has not improved") == 1


# -- the average under an outer loop: of the anchors, the params every rank agreed on --------------------
def test_under_an_outer_loop_the_average_follows_the_anchor_every_rank_agreed_on(tmp_path):
    """Local SGD on two ranks, syncing every 2 steps: between syncs each rank's params are its own, the anchor (the
    params of the last sync) is every rank's; the saved average is the moving average of the anchors, by hand."""
    decay, steps = 0.5, 6
    run(
        compose(
            *SMALL,
            "world=local2",
            "world.backend=gloo",
            f"trainer.max_steps={steps}",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=1",
            f"trainer.keep_checkpoints={steps}",
            f"trainer.ema_decay={decay}",
            "outer=local_sgd",
            "outer.sync_every=2",
            "trainer.checkpoint_format=whole",  # read below entry by entry, each rank's own
        ),
        tmp_path,
    )
    saved = [checkpoint(tmp_path, f"step_{step:08d}.pt") for step in range(1, steps + 1)]
    names = list(saved[0]["params"])
    # The outer state's leaves begin with the anchor, in the params' order; rank 0's and rank 1's alike.
    anchors = [dict(zip(names, ck["ranks"][0]["outer"][: len(names)])) for ck in saved]
    assert all(
        max_diff(dict(zip(names, ck["ranks"][1]["outer"][: len(names)])), a) == 0 for ck, a in zip(saved, anchors)
    )
    assert max_diff(anchors[1], saved[1]["ranks"][0]["params"]) == 0  # a sync (step 2): every rank at the anchor
    assert max_diff(saved[0]["ranks"][0]["params"], saved[0]["ranks"][1]["params"]) > 0  # step 1: ranks apart
    average = dict(anchors[0])  # the anchor before the first sync: the params the run started from
    for ck, anchor in zip(saved, anchors):
        average = {n: decay * average[n] + (1 - decay) * anchor[n] for n in names}
        assert max_diff(ck["ema"], average) <= 1e-6, ck["step"]
    assert max_diff(saved[-1]["ema"], anchors[-1]) > 1e-3  # an average, not the last anchor
