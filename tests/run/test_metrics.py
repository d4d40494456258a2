"""What a run reports: metrics.jsonl and, with trainer.tensorboard=true, TensorBoard scalars
read back with TensorBoard's own event reader."""

import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fdp.errors import ConfigError
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.report.metrics import MetricsLog, read_metrics
from fdp.run.trainer import run

SMALL = [
    "model.hidden=16",
    "data.global_batch_size=16",
    "trainer.progress=false",
    "trainer.max_steps=6",
    "trainer.log_every=2",
    "trainer.eval_every=4",
]


def scalars(log_dir):
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_scalars_are_the_logged_metrics_written_by_rank_0_only(tmp_path):
    run(compose(*SMALL, "world=local2", "world.backend=gloo", "trainer.tensorboard=true"), tmp_path)
    steps, summary = read_metrics(tmp_path)
    assert summary is not None and [r["step"] for r in steps] == [2, 4, 6]
    written = scalars(tmp_path / "tb")
    assert {"loss", "lr", "samples_per_s", "comm_wait_ms", "bytes_sent", "val_loss", "test_acc"} <= set(written)
    for tag in ("loss", "lr", "bytes_sent"):  # float32 in the event file
        assert [s for s, _ in written[tag]] == [2, 4, 6]
        assert [v for _, v in written[tag]] == pytest.approx([r[tag] for r in steps], rel=1e-6)
    assert [s for s, _ in written["val_acc"]] == [4, 6]
    assert [s for s, _ in written["test_acc"]] == [6]  # the test split, scored once at the end
    # One writer: rank 0's (rank 1 would add a second event file).
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1


def test_tensorboard_is_off_by_default_and_the_log_skips_what_is_not_a_number(tmp_path):
    log = MetricsLog(tmp_path / "off")
    log.write({"step": 1, "loss": 1.0})
    log.close()
    assert not (tmp_path / "off" / "tb").exists()
    log = MetricsLog(tmp_path / "on", tensorboard=True)
    log.write({"step": 1, "loss": 1.5, "compression": None, "nan_loss": float("nan"), "skipped": True})
    log.write({"summary": True, "loss": 9.0})  # the closing summary is not a step
    log.close()
    assert scalars(tmp_path / "on" / "tb") == {"loss": [(1, 1.5)]}


def test_tensorboard_asked_for_but_not_installed_is_one_line_naming_the_setting_and_the_fix(monkeypatch):
    # As if the package were missing: importing it (and torch's writer built on it) fails.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    cfg = compose(*SMALL, "trainer.tensorboard=true")
    with pytest.raises(ConfigError) as caught:
        validate(cfg)
    assert str(caught.value) == (
        "trainer.tensorboard=true: expected the tensorboard package to be installed "
        "(pip install tensorboard, or pip install -e '.[tensorboard]')"
    )
    validate(compose(*SMALL))  # not asked for: no need for the package


@pytest.mark.parametrize("eval_every, log_every", [(8, 10), (3, 2), (4, 1), (5, 7)])
def test_evaluations_happen_every_eval_every_steps_whatever_log_every_is(tmp_path, eval_every, log_every):
    # Each "every N steps" setting counts its own steps: evaluations at the multiples of eval_every (and the
    # last step), records at those and at the multiples of log_every, checkpoints at the multiples of 5.
    last = 24
    settings = [
        *SMALL,
        f"trainer.max_steps={last}",
        f"trainer.eval_every={eval_every}",
        f"trainer.log_every={log_every}",
        "trainer.checkpoint_every=5",
        "trainer.keep_checkpoints=100",
    ]
    run(compose(*settings), tmp_path)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt"))
    assert saved == [f"step_{s:08d}.pt" for s in (5, 10, 15, 20, 24)]
    steps, _ = read_metrics(tmp_path)
    evaluated = [r["step"] for r in steps if "val_loss" in r]
    assert evaluated == sorted({*range(eval_every, last + 1, eval_every), last})
    logged = {*range(log_every, last + 1, log_every), last}
    assert [r["step"] for r in steps] == sorted(logged | set(evaluated))
