"""What a run reports: ``metrics.jsonl`` lines, a progress bar and a closing summary."""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    """Appends one JSON object per logged step to ``<run dir>/metrics.jsonl``.

    >>> log = MetricsLog("/tmp/fdp-example-run")
    >>> log.write({"step": 1, "loss": torch.tensor(2.5)})
    >>> log.close()
    """

    def __init__(self, run_dir: str | Path, resume: bool = False):
        path = Path(run_dir) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a" if resume else "w", buffering=1)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        self._file.close()


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
        self.rows.append({k: metrics[k] for k in ("step_s", "compute_s", "comm_wait_s", "bytes_sent")})

    def median(self, key: str) -> float:
        rows = self.rows[self.warmup :] or self.rows
        return statistics.median(r[key] for r in rows) if rows else float("nan")


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
