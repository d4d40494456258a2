"""Where a run's records go besides ``metrics.jsonl``: ``trainer.loggers=[tensorboard,csv,mlflow,wandb]``.

* ``tensorboard``: scalars under ``<run dir>/tb/`` (``fdp.run.report.metrics.TensorBoardLog``; also
  ``trainer.tensorboard=true``). View with ``tensorboard --logdir <run dir>/tb``.
* ``csv``: ``<run dir>/metrics.csv``, a row per logged step, a column per metric (a metric
  first seen later, such as ``test_loss``, adds its column to every row).
* ``mlflow``: an MLflow run in ``<run dir>/mlflow.db`` (MLflow's local SQLite store: its
  plain file store is refused by MLflow 3 unless opted into), with the run's settings as
  params. View with ``mlflow ui --backend-store-uri sqlite:///<run dir>/mlflow.db``.
  An optional extra (``pip install -e '.[mlflow]'``); refused in one line when missing.
* ``wandb``: a Weights & Biases run with the run's settings as its config, its files under
  ``<run dir>/wandb/``. Offline (local files only; ``wandb sync <run dir>/wandb/offline-run-*``
  uploads them later) unless an API key is set (``WANDB_API_KEY`` or ``wandb login``) or
  ``WANDB_MODE`` says otherwise; ``WANDB_PROJECT`` names the project (default ``fdp``).
  An optional extra (``pip install -e '.[wandb]'``); refused in one line when missing.

Rank 0 writes them all; a resumed run goes on in the same files and the same MLflow run.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import os
import time
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fdp.errors import ConfigError
from fdp.run.report.metrics import TensorBoardLog, check_tensorboard

__all__ = [
    "LOGGERS",
    "CsvLog",
    "MlflowLog",
    "WandbLog",
    "check_loggers",
    "check_mlflow",
    "check_wandb",
    "mlflow_uri",
    "open_loggers",
    "wandb_mode",
]

LOGGERS = ("tensorboard", "csv", "mlflow", "wandb")
CSV_FILE = "metrics.csv"
MLFLOW_FILE = "mlflow.db"
MLFLOW_EXPERIMENT = "fdp"
_PARAM_CHARS = 500  # MLflow keeps params short; a longer value (a list of stages) is cut


def check_loggers(names: Iterable[str], tensorboard: bool = False) -> tuple[str, ...]:
    """``loggers`` (each once, from ``LOGGERS``) with ``tensorboard=True`` folded in; their packages installed.

    >>> check_loggers(["csv"], tensorboard=False)
    ('csv',)
    >>> check_loggers(["neptune"])
    Traceback (most recent call last):
    ...
    ValueError: loggers=['neptune']: expected a list of tensorboard, csv, mlflow, wandb
    """
    names = list(names)
    if any(name not in LOGGERS for name in names) or len(set(names)) != len(names):
        raise ValueError(f"loggers={names!r}: expected a list of {', '.join(LOGGERS)}")
    chosen = tuple(n for n in LOGGERS if n in names or n == "tensorboard" and tensorboard)
    if "tensorboard" in chosen:
        check_tensorboard()
    if "mlflow" in chosen:
        check_mlflow()
    if "wandb" in chosen:
        check_wandb()
    return chosen


def check_wandb() -> None:
    """Refuse ``wandb`` among the loggers in one line when the package is missing."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "trainer.loggers=[wandb]: expected the wandb package to be installed "
            "(pip install wandb, or pip install -e '.[wandb]')"
        )


def wandb_mode(environ: dict | None = None, netrc_file: str | Path | None = None) -> str:
    """W&B's mode for a run: ``WANDB_MODE`` where set, else ``online`` with an API key (``WANDB_API_KEY``, or
    the one ``wandb login`` keeps in ``~/.netrc``), else ``offline``: local files only, nothing sent.

    >>> wandb_mode({}, netrc_file="/nonexistent"), wandb_mode({"WANDB_API_KEY": "k"}), wandb_mode({"WANDB_MODE": "x"})
    ('offline', 'online', 'x')
    """
    import netrc

    environ = os.environ if environ is None else environ
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    if environ.get("WANDB_API_KEY"):
        return "online"
    try:
        known = netrc.netrc(netrc_file).authenticators("api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        known = None
    return "online" if known else "offline"


def check_mlflow() -> None:
    """Refuse ``mlflow`` among the loggers in one line when the package is missing."""
    if importlib.util.find_spec("mlflow") is None:  # found without importing it (seconds)
        raise ConfigError(
            "trainer.loggers=[mlflow]: expected the mlflow package to be installed "
            "(pip install mlflow, or pip install -e '.[mlflow]')"
        )


def mlflow_uri(run_dir: str | Path) -> str:
    """The tracking URI of a run's MLflow store (what ``mlflow ui --backend-store-uri`` takes).

    >>> mlflow_uri("/runs/a")
    'sqlite:////runs/a/mlflow.db'
    """
    return f"sqlite:///{Path(run_dir).resolve() / MLFLOW_FILE}"


def open_loggers(names: Iterable[str], run_dir: str | Path, resume: bool, settings: dict | None = None) -> list:
    """The loggers ``names`` writing into ``run_dir`` (``resume``: going on in the files of a previous
    invocation); ``settings``: the run's config, which MLflow records as the run's params."""
    made: list = []
    for name in names:
        if name == "tensorboard":
            made.append(TensorBoardLog(run_dir))
        elif name == "csv":
            made.append(CsvLog(run_dir, resume))
        elif name == "mlflow":
            made.append(MlflowLog(run_dir, resume, settings or {}))
        elif name == "wandb":
            made.append(WandbLog(run_dir, resume, settings or {}))
    return made


def _is_value(value: Any) -> bool:
    return value is None or isinstance(value, (int, float, str))


class CsvLog:
    """A row per logged step in ``<run dir>/metrics.csv``; the summary and other records are left to ``metrics.jsonl``.

    >>> import tempfile
    >>> directory = tempfile.mkdtemp()
    >>> log = CsvLog(directory)
    >>> log.write({"step": 1, "loss": 2.5}); log.write({"step": 2, "loss": 2.0, "test_loss": 2.2}); log.close()
    >>> print((Path(directory) / "metrics.csv").read_text().strip())
    step,loss,test_loss
    1,2.5,
    2,2.0,2.2
    """

    def __init__(self, run_dir: str | Path, resume: bool = False):
        self.path = Path(run_dir) / CSV_FILE
        self.columns: list[str] = []
        if resume and self.path.is_file():
            with open(self.path, newline="") as f:
                self.columns = next(csv.reader(f), [])
        else:
            self.path.write_text("")

    def write(self, record: dict) -> None:
        if record.get("summary") or record.get("shrink") or "step" not in record:
            return
        row = {k: v for k, v in record.items() if _is_value(v)}
        new = [k for k in row if k not in self.columns]
        if new:  # a column first seen now: every row gets it (the file is rewritten whole, atomically)
            self._widen(self.columns + new)
        line = io.StringIO()
        csv.DictWriter(line, self.columns, lineterminator="\n").writerow(row)
        with open(self.path, "a", newline="") as f:
            f.write(line.getvalue())

    def _widen(self, columns: list[str]) -> None:
        with open(self.path, newline="") as f:
            rows = list(csv.DictReader(f)) if self.columns else []
        out = io.StringIO()
        writer = csv.DictWriter(out, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(out.getvalue())
        os.replace(tmp, self.path)
        self.columns = columns

    def close(self) -> None:
        pass


def _flat(tree: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): str(tree)[:_PARAM_CHARS]}


class MlflowLog:
    """Each logged step's numbers as MLflow metrics of one run in ``<run dir>/mlflow.db`` (see the module)."""

    def __init__(self, run_dir: str | Path, resume: bool = False, settings: dict | None = None):
        check_mlflow()
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # Their notes on making the store's tables are not the run's output (set once mlflow has set its own).
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)

        run_dir = Path(run_dir).resolve()
        self.client = MlflowClient(tracking_uri=mlflow_uri(run_dir))
        with warnings.catch_warnings():  # SQLAlchemy's deprecation notes on MLflow's own use of it
            warnings.simplefilter("ignore", DeprecationWarning)
            experiment = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(MLFLOW_EXPERIMENT, artifact_location=(run_dir / "mlartifacts").as_uri())
        )
        # The store belongs to this run directory: a resumed run goes on in the run it holds.
        runs = (
            self.client.search_runs([experiment_id], max_results=1, order_by=["attributes.start_time DESC"])
            if resume
            else []
        )
        if runs:
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(
                experiment_id, run_name=run_dir.name, tags={"fdp.run_dir": str(run_dir)}
            ).info.run_id
            params = [Param(k, v) for k, v in sorted(_flat(settings or {}).items())]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.status = "FINISHED"

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        if record.get("summary"):
            self.status = "KILLED" if record.get("interrupted") else "FINISHED"
            return
        step = record.get("step")
        if step is None or record.get("shrink"):
            return
        now = int(time.time() * 1000)
        metrics = [
            Metric(k, float(v), now, int(step))
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status=self.status)


class WandbLog:
    """Each logged step's numbers in one W&B run, its files under ``<run dir>/wandb/`` (see the module).

    A resumed run goes on in the same W&B run: its id is kept in ``<run dir>/wandb/fdp-run-id``.
    """

    def __init__(self, run_dir: str | Path, resume: bool = False, settings: dict | None = None):
        check_wandb()
        import wandb

        run_dir = Path(run_dir).resolve()
        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        id_file = run_dir / "wandb" / "fdp-run-id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        if not run_id:
            run_id = uuid.uuid4().hex[:12]  # W&B run ids: lowercase letters and digits
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "fdp"),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=settings or {},
            mode=wandb_mode(),
            # fdp's own output stays as it is: W&B neither wraps the console nor prints its banner
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True),
        )
        self.exit_code = 0

    def write(self, record: dict) -> None:
        if record.get("summary"):
            self.exit_code = 1 if record.get("interrupted") else 0
            return
        step = record.get("step")
        if step is None or record.get("shrink") or record.get("grow"):
            return
        numbers = {
            k: float(v)
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if numbers:
            self.run.log(numbers, step=int(step))

    def close(self) -> None:
        self.run.finish(exit_code=self.exit_code)
