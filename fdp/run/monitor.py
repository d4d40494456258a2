"""A metric the evaluations are judged by: which way is better, early stopping's count, the best kept, and
whether a run's evaluations will report it at all (checked before step 1).

Small values updated once per evaluation, the same on every rank (each receives rank 0's
record), and saved with the loop's state (``fdp.run.loop_controls``), so a resumed run
decides as the uninterrupted one would.

>>> stopping_update(Stopping(), 0.9, Monitor.of("test_loss"))
Stopping(best=0.9, waited=0)
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from fdp.errors import ConfigError, one_of, require

__all__ = [
    "MODES",
    "Monitor",
    "Stopping",
    "check_mode",
    "check_monitored",
    "check_monitored_split",
    "ranked",
    "stopping_update",
]

MODES = ("auto", "min", "max")


def check_mode(mode: str) -> str:
    """``mode``: ``auto`` (max for an accuracy, min otherwise), ``min`` or ``max``."""
    require(mode in MODES, "mode", mode, "auto, min or max")
    return mode


class Monitor(NamedTuple):
    """A metric of the evaluations and which way is better (``min_delta``: the least change that counts).

    >>> Monitor.of("test_acc").mode, Monitor.of("test_loss").mode
    ('max', 'min')
    >>> Monitor.of("test_loss", min_delta=0.1).better(0.95, 1.0)
    False
    """

    name: str
    mode: str
    min_delta: float = 0.0

    @staticmethod
    def of(name: str, mode: str = "auto", min_delta: float = 0.0) -> Monitor:
        if check_mode(mode) == "auto":
            mode = "max" if re.search(r"acc|accuracy|f1|auc", name) else "min"
        return Monitor(name, mode, min_delta)

    def better(self, value: float, than: float | None) -> bool:
        """Whether ``value`` improves on ``than`` (anything improves on ``None``; NaN never does)."""
        if math.isnan(value):
            return False
        if than is None:
            return True
        return value < than - self.min_delta if self.mode == "min" else value > than + self.min_delta

    def read(self, record: dict, setting: str) -> float:
        """The metric from an evaluation's ``record``; a name it lacks is refused naming ``setting``."""
        value = record.get(self.name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            known = sorted(k for k, v in record.items() if isinstance(v, float) and k != "lr")
            raise ConfigError(f"{setting}={self.name!r}: expected a metric of the evaluations: {', '.join(known)}")
        return float(value)


class Stopping(NamedTuple):
    """Early stopping's state: the best value so far and the evaluations since it improved."""

    best: float | None = None
    waited: int = 0


def stopping_update(stopping: Stopping, value: float, monitor: Monitor) -> Stopping:
    """The state after one more evaluation.

    >>> s = Stopping()
    >>> for loss in (1.0, 0.9, 0.95, 0.91):
    ...     s = stopping_update(s, loss, Monitor.of("test_loss"))
    >>> s
    Stopping(best=0.9, waited=2)
    """
    if monitor.better(value, stopping.best):
        return Stopping(value, 0)
    return Stopping(stopping.best, stopping.waited + 1)


def ranked(best: tuple, value: float, step: int, keep: int, monitor: Monitor) -> tuple[tuple, bool]:
    """``best`` (``(value, step)`` pairs, best first) with this evaluation ranked in, at most ``keep``; and
    whether it made the cut.

    >>> best, kept = ranked(((0.5, 10), (0.7, 20)), 0.6, 30, 2, Monitor.of("test_loss"))
    >>> best, kept
    (((0.5, 10), (0.6, 30)), True)
    """
    if math.isnan(value):
        return best, False
    entries = list(best)
    ahead = (lambda v: value < v) if monitor.mode == "min" else (lambda v: value > v)  # a tie ranks after
    position = next((i for i, (v, _) in enumerate(entries) if ahead(v)), len(entries))
    entries.insert(position, (value, step))
    entries = entries[:keep]
    return tuple(entries), position < keep


def check_monitored_split(setting: str, name: str, splits: tuple) -> None:
    """Refuse a monitored metric of a split the evaluations during training do not score: they score the
    first of ``splits`` (the validation split, else the test split); the test split beside a validation
    split is scored only at the end, where it selects nothing.

    >>> check_monitored_split("trainer.keep_best", "val_acc", ("val", "test"))
    >>> check_monitored_split("trainer.checkpoint_monitor", "ema_test_loss", ("val", "test"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: trainer.checkpoint_monitor='ema_test_loss': expected a metric of the validation split, ...
    """
    if not splits:
        raise ConfigError(f"{setting}={name!r}: expected data with a validation or a test split to evaluate on")
    named = re.match(r"(ema_)?(val|test)_(.*)", name)
    if named is None or named.group(2) == splits[0]:
        return
    ema_, _, rest = named.groups()
    if splits[0] == "val":
        why = "the test split is scored once, at the end; data.val_fraction=0 scores it during training instead"
        raise ConfigError(
            f"{setting}={name!r}: expected a metric of the validation split, {ema_ or ''}val_{rest} ({why})"
        )
    raise ConfigError(
        f"{setting}={name!r}: expected a metric of the test split, {ema_ or ''}test_{rest} (the data has no "
        "validation split: set data.val_fraction, or give the data one of its own)"
    )


TRAINING = ("loss",)  # the training loss, in every record an evaluation adds to: a monitor may watch it too


def check_monitored(setting: str, name: str, evaluated: tuple[str, ...]) -> None:
    """Refuse, before step 1, a monitored metric the run's records will not hold when it evaluates.

    >>> check_monitored("trainer.checkpoint_monitor", "test_los", ("test_loss", "test_acc"))
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: trainer.checkpoint_monitor='test_los': expected a metric of the evaluations: \
test_loss, test_acc or loss
    """
    if not evaluated:
        raise ConfigError(f"{setting}={name!r}: expected data with a validation or a test split to evaluate on")
    require(
        name in (*evaluated, *TRAINING),
        setting,
        name,
        f"a metric of the evaluations: {one_of((*evaluated, *TRAINING))}",
        ConfigError,
    )
