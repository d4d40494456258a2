"""What a run reports: ``metrics.jsonl`` lines (and TensorBoard scalars), a progress bar and a closing summary."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from fdp.errors import ConfigError

TENSORBOARD_DIR = "tb"


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    """Appends one JSON object per logged step to ``<run dir>/metrics.jsonl``.

    With ``tensorboard=True`` each step's numbers also go to ``<run dir>/tb/`` as
    TensorBoard scalars (``TensorBoardLog``); each of ``loggers`` (objects with ``write(record)``
    and ``close()``: ``fdp.run.report.loggers``) gets every record too.

    >>> import tempfile
    >>> log = MetricsLog(tempfile.mkdtemp())
    >>> log.write({"step": 1, "loss": torch.tensor(2.5)})
    >>> log.close()
    """

    def __init__(self, run_dir: str | Path, resume: bool = False, tensorboard: bool = False, loggers: list = ()):
        path = Path(run_dir) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a" if resume else "w", buffering=1)
        self._loggers = [*([TensorBoardLog(run_dir)] if tensorboard else []), *loggers]

    def write(self, record: dict) -> None:
        plain = {k: _plain(v) for k, v in record.items()}
        self._file.write(json.dumps(plain) + "\n")
        for logger in self._loggers:
            logger.write(plain)

    def close(self) -> None:
        self._file.close()
        for logger in self._loggers:
            logger.close()


def check_tensorboard() -> None:
    """Refuse ``trainer.tensorboard=true`` in one line when the ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (needs the tensorboard package)
    except ImportError:
        raise ConfigError(
            "trainer.tensorboard=true: expected the tensorboard package to be installed "
            "(pip install tensorboard, or pip install -e '.[tensorboard]')"
        ) from None


class TensorBoardLog:
    """Writes each logged step's numbers as TensorBoard scalars to ``<run dir>/tb/``.

    A record's ``step`` is the scalars' step; its other numeric values are the scalars
    (``loss``, ``lr``, ``samples_per_s``, ``test_acc``...), under their own names. The
    run's closing summary is not a step and is left out. View with
    ``tensorboard --logdir <run dir>/tb``.

    >>> import tempfile
    >>> tb = TensorBoardLog(tempfile.mkdtemp())
    >>> tb.write({"step": 1, "loss": 2.5, "compression": None})
    >>> tb.close()
    """

    def __init__(self, run_dir: str | Path):
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(run_dir) / TENSORBOARD_DIR
        self._writer = SummaryWriter(log_dir=str(self.path))

    def write(self, record: dict) -> None:
        step = record.get("step")
        if record.get("summary") or step is None:
            return
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


def read_metrics(run_dir: str | Path) -> tuple[list[dict], dict | None]:
    """The logged steps of a run and its summary (``None`` while it is still running).

    Example::

        steps, summary = read_metrics("outputs/2026-11-21/10-00-00")
        losses = [s["loss"] for s in steps]
    """
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    summary = next((r for r in reversed(records) if r.get("summary")), None)
    return [r for r in records if not r.get("summary")], summary


class StepTimes:
    """Running per-step timings; medians skip the first steps (allocation, warm caches)."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.rows: list[dict] = []

    def add(self, metrics: dict) -> None:
        self.rows.append(
            {k: metrics.get(k, 0.0) for k in ("step_s", "compute_s", "comm_wait_s", "bytes_sent", "data_wait_s")}
        )

    def median(self, key: str) -> float:
        rows = self.rows[self.warmup :] or self.rows
        return statistics.median(r[key] for r in rows) if rows else float("nan")

    def mean(self, key: str) -> float:
        """The mean over every step, the first ones too (where a start-up stall shows)."""
        return statistics.fmean(r[key] for r in self.rows) if self.rows else float("nan")


def progress(total: int, initial: int, enabled: bool):
    """A tqdm bar on stderr (or a silent stand-in when disabled)."""
    from tqdm.auto import tqdm

    # Not a terminal (CI, log files): fewer, longer-spaced updates.
    interval = 0.1 if sys.stderr.isatty() else 10.0
    return tqdm(total=total, initial=initial, disable=not enabled, file=sys.stderr, mininterval=interval, unit="step")


def summary_line(summary: dict) -> str:
    """One line for the end of a run: ``key=value`` pairs, numbers rounded for reading."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    return "fdp: " + " ".join(f"{k}={fmt(v)}" for k, v in summary.items())
