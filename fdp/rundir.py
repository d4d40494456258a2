"""A run's directory: where each of its files lives, named in one place.

::

    <run dir>/
      metrics.jsonl        one JSON object per logged step, and the summary (rank 0)
      checkpoints/         step_<N>.pt and last.pt (fdp.checkpoint)
      plan.txt, plan.json  the bucket plan, as a table and as JSON
      ranks/rank<N>.txt    each rank's pid and the step it is computing (RankStatus)
      rank<N>.log          what ranks other than 0 log
      trace/rank<N>.json   Chrome traces (trainer.trace=true)
      tb/                  TensorBoard scalars (trainer.tensorboard=true)

>>> RunDir("outputs/run").last_checkpoint.as_posix()
'outputs/run/checkpoints/last.pt'
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from fdp.checkpoint import LAST

__all__ = ["RunDir", "RankStatus"]


class RunDir(NamedTuple):
    """The paths of one run directory's files (see the module docstring)."""

    path: Path

    @property
    def metrics(self) -> Path:
        return Path(self.path) / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return Path(self.path) / "checkpoints"

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / LAST

    @property
    def plan_table(self) -> Path:
        return Path(self.path) / "plan.txt"

    @property
    def plan_json(self) -> Path:
        return Path(self.path) / "plan.json"

    @property
    def tensorboard(self) -> Path:
        return Path(self.path) / "tb"

    def rank_status(self, rank: int) -> Path:
        return Path(self.path) / "ranks" / f"rank{rank}.txt"

    def rank_log(self, rank: int) -> Path:
        return Path(self.path) / f"rank{rank}.log"

    def trace(self, rank: int) -> Path:
        return Path(self.path) / "trace" / f"rank{rank}.json"

    def has_run(self) -> bool:
        """Whether a run already wrote here (metrics or checkpoints)."""
        return self.metrics.exists() or self.checkpoints.exists()


class RankStatus:
    """``<run dir>/ranks/rank<N>.txt``: ``pid=<pid> step=<step being computed>``, rewritten each step.

    It tells the launcher which step a rank that died by a signal was on, and an operator
    (or a test) which process is which rank. One ``pwrite`` per step, no fsync.
    """

    def __init__(self, run_dir: RunDir, rank: int):
        path = run_dir.rank_status(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pid = os.getpid()
        self.step = 0

    @staticmethod
    def read(run_dir: RunDir | str | os.PathLike, rank: int) -> dict[str, int]:
        """``{"pid": ..., "step": ...}`` as rank ``rank`` of the run in ``run_dir`` last wrote them (empty if never)."""
        run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        try:
            text = run_dir.rank_status(rank).read_text()
        except OSError:
            return {}
        return {key: int(value) for key, value in re.findall(r"(\w+)=(\d+)", text)}

    def update(self, step: int) -> None:
        # Within one process the line only grows (the step never decreases), so an
        # in-place write never leaves a stale tail.
        self.step = step
        os.pwrite(self._fd, f"pid={self._pid} step={step}\n".encode(), 0)

    def close(self) -> None:
        os.close(self._fd)
