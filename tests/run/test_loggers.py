"""Loggers beside metrics.jsonl: CSV and MLflow files a run writes, and the one-line refusals."""

import csv
import sys

import pytest

from fdp.errors import ConfigError
from fdp.run.config.compose import compose
from fdp.run.config.validate import validate
from fdp.run.report.loggers import CsvLog, check_loggers, mlflow_uri
from fdp.run.report.metrics import read_metrics
from fdp.run.trainer import run

SMALL = [
    "model=mlp",
    "model.hidden=32",
    "trainer.progress=false",
    "data.global_batch_size=32",
    "trainer.eval_batches=2",
]


def test_csv_gains_columns_in_every_row_and_a_resumed_log_goes_on_in_the_same_file(tmp_path):
    log = CsvLog(tmp_path)
    log.write({"step": 1, "loss": 2.5, "compression": None})
    log.write({"step": 2, "loss": 2.0, "test_loss": 2.25})
    log.write({"summary": True, "steps": 2})  # the summary stays in metrics.jsonl
    log.close()
    log = CsvLog(tmp_path, resume=True)
    log.write({"step": 3, "loss": 1.5, "test_acc": 0.5})
    log.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert list(rows[0]) == ["step", "loss", "compression", "test_loss", "test_acc"]
    assert rows[0]["test_loss"] == "" and rows[1]["test_loss"] == "2.25" and rows[2]["test_acc"] == "0.5"
    CsvLog(tmp_path)  # a new run starts the file over
    assert (tmp_path / "metrics.csv").read_text() == ""


def test_a_run_stopped_and_resumed_logs_to_csv_and_one_mlflow_run_with_its_settings(tmp_path):
    from mlflow.tracking import MlflowClient

    settings = [
        *SMALL,
        "trainer.max_steps=4",
        "trainer.log_every=2",
        "trainer.eval_every=4",
        "trainer.loggers=[csv,mlflow]",
    ]
    run(compose(*settings, "trainer.stop_at=2"), tmp_path)
    run(compose(*settings, "trainer.resume=true"), tmp_path)  # goes on in the same files and MLflow run
    steps, summary = read_metrics(tmp_path)
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [s["step"] for s in steps] == [2, 4]
    assert float(rows[-1]["test_loss"]) == pytest.approx(summary["test_loss"])
    client = MlflowClient(tracking_uri=mlflow_uri(tmp_path))
    (mlrun,) = client.search_runs([client.get_experiment_by_name("fdp").experiment_id])
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["trainer.max_steps"] == "4"
    history = client.get_metric_history(mlrun.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s["step"], pytest.approx(s["loss"])) for s in steps]
    assert mlrun.data.metrics["test_acc"] == pytest.approx(summary["test_acc"])


def test_mlflow_not_installed_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` meets without the package
    with pytest.raises(ConfigError) as error:
        validate(compose("trainer.loggers=[csv,mlflow]"))
    assert str(error.value) == (
        "trainer.loggers=[mlflow]: expected the mlflow package to be installed "
        "(pip install mlflow, or pip install -e '.[mlflow]')"
    )


def test_tensorboard_setting_is_the_tensorboard_logger():
    assert check_loggers([], tensorboard=True) == ("tensorboard",)
    assert check_loggers(["mlflow", "csv", "tensorboard"]) == ("tensorboard", "csv", "mlflow")
    with pytest.raises(ValueError, match=r"loggers=\['csv', 'csv'\]: expected a list of"):
        check_loggers(["csv", "csv"])


def test_wandb_logs_a_stopped_and_resumed_run_offline_to_one_run_of_local_files(tmp_path, monkeypatch):
    """Without an API key W&B runs offline: each invocation writes its records and the run's settings under
    <run dir>/wandb/offline-run-*/, both as the one W&B run (its id kept in the run directory), sending nothing."""
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no key from `wandb login` either
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = [*SMALL, "trainer.max_steps=4", "trainer.log_every=2", "trainer.eval_every=4", "trainer.loggers=[wandb]"]
    run(compose(*settings, "trainer.stop_at=2"), tmp_path)
    run(compose(*settings, "trainer.resume=true"), tmp_path)
    run_id = (tmp_path / "wandb" / "fdp-run-id").read_text().strip()
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2, files
    for f in files:
        written = f.read_bytes()
        assert b"grad_norm" in written and b"max_steps" in written  # a logged record, and the settings
