"""A per-rank timeline of the train step in Chrome's trace format.

Open the file in chrome://tracing or https://ui.perfetto.dev. The main track shows
forward, backward and the optimizer; each bucket's reduction is an async span from the
moment its hook chain starts to the moment its result is in, with one slice per
collective inside, so overlap of communication with backward shows as bucket spans
that begin inside the backward span.

The train step always talks to a timeline; with tracing off it gets a ``NullTimeline``,
whose methods do nothing, so the step has no tracing branches.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path


class Timeline:
    """Collects trace events for one rank; ``save`` writes them as Chrome trace JSON.

    >>> timeline = Timeline(rank=0)
    >>> with timeline.span("optimizer"):
    ...     pass
    >>> len(timeline.events)
    1
    """

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.events: list[dict] = []
        self.step = 0
        self.forward_end_us = 0.0
        self._t0 = time.perf_counter()

    def start_step(self, step: int) -> None:
        """Label the events that follow with ``step``."""
        self.step = step

    def now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def mark_forward_end(self) -> None:
        """Note that the forward is done (the backward starts next)."""
        self.forward_end_us = self.now_us()

    def forward_backward(self, start_us: float, micro_batch: int) -> None:
        """The forward and backward spans of one micro-batch that started at ``start_us``."""
        self.complete("forward", start_us, self.forward_end_us, micro_batch=micro_batch)
        self.complete("backward", self.forward_end_us, self.now_us(), micro_batch=micro_batch)

    def complete(self, name: str, start_us: float, end_us: float, cat: str = "step", **args) -> None:
        """A finished span on the main track."""
        self.events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": start_us,
                "dur": max(0.0, end_us - start_us),
                "pid": self.rank,
                "tid": 0,
                "args": {"step": self.step, **args},
            }
        )

    @contextmanager
    def span(self, name: str, cat: str = "step", **args):
        start = self.now_us()
        try:
            yield
        finally:
            self.complete(name, start, self.now_us(), cat, **args)

    def _async(self, phase: str, name: str, bucket: int, cat: str, args: dict) -> None:
        self.events.append(
            {
                "name": name,
                "cat": cat,
                "ph": phase,
                "ts": self.now_us(),
                "pid": self.rank,
                "tid": 0,
                "id": f"{self.step}.{bucket}",
                "args": {"step": self.step, "bucket": bucket, **args},
            }
        )

    def bucket_begin(self, bucket: int) -> None:
        self._async("b", f"bucket {bucket}", bucket, "bucket", {})

    def bucket_end(self, bucket: int) -> None:
        self._async("e", f"bucket {bucket}", bucket, "bucket", {})

    def collective_begin(self, bucket: int, number: int) -> None:
        self._async("b", f"collective {number}", bucket, "bucket", {})

    def collective_end(self, bucket: int, number: int) -> None:
        self._async("e", f"collective {number}", bucket, "bucket", {})

    def gather_begin(self, bucket: int) -> None:
        """ZeRO stage 3: bucket ``bucket``'s params start their all-gather."""
        self._async("b", f"gather {bucket}", bucket, "gather", {})

    def gather_end(self, bucket: int) -> None:
        self._async("e", f"gather {bucket}", bucket, "gather", {})

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        os.replace(tmp, path)
        return path


class NullTimeline(Timeline):
    """A timeline that records nothing: what the step talks to when tracing is off.

    >>> timeline = NullTimeline()
    >>> with timeline.span("optimizer"):
    ...     timeline.bucket_begin(0)
    >>> timeline.events
    []
    """

    _NOTHING = contextlib.nullcontext()

    def __init__(self, rank: int = 0):
        super().__init__(rank)

    def now_us(self) -> float:
        return 0.0

    def mark_forward_end(self) -> None:
        pass

    def forward_backward(self, start_us: float, micro_batch: int) -> None:
        pass

    def complete(self, name: str, start_us: float, end_us: float, cat: str = "step", **args) -> None:
        pass

    def span(self, name: str, cat: str = "step", **args):
        return self._NOTHING

    def _async(self, phase: str, name: str, bucket: int, cat: str, args: dict) -> None:
        pass

    def save(self, path: str | os.PathLike) -> None:
        return None
