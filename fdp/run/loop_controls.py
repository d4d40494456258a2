"""When a run ends before ``max_steps``, which checkpoints it keeps as its best, and its moving average.

* ``trainer.max_epochs``: the run's length in passes over the training data
  (``run_steps``); the learning-rate schedule spans it.
* ``trainer.max_time``: training time (counted across resumes) after which every rank
  stops at the same step boundary with a checkpoint, as after a stop signal. Rank 0's
  clock decides; its verdict reaches the others through a small all-reduce of its own,
  read one step later, so no step waits for it (``Deadline``).
* ``trainer.early_stopping``: stop once a monitored metric of the evaluations (``val_loss`` unless
  named) has not improved for ``patience`` evaluations (0: never). Rank 0 evaluates; every rank
  receives its record (``fdp.run.report.records``) and updates the same small value, so all decide alike.
* ``trainer.keep_best`` / ``trainer.checkpoint_monitor``: the ``keep_best`` best checkpoints by
  that metric (``val_loss`` unless named), kept as ``checkpoints/best/step=<N>-<metric>=<value>.pt``
  (a copy) or, in the sharded format, as that step's directory of hard links (no bytes copied)
  (atomically) beside the newest ones. This module ranks them (``best_names``); the run's checkpoints keep
  them (``fdp.run.checkpoint``).

Both watch the evaluations during training, which score the validation split: the test split,
scored once at the end, never selects a model (``fdp.data.splits``).
* ``trainer.ema_decay``: a moving average of the params (``fdp.optim.ema``), evaluated as
  ``ema_<metric>`` and saved whole in each checkpoint (``ema``). Under an outer loop it follows
  the anchor, the params every rank agreed on at the last sync (``agreed_params``).

What these decide with (the stopping counter, the best values so far, the training time,
the average) is saved in every checkpoint (``loop``, ``ema``), so a resumed run goes on
exactly as the uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fdp.comm import Comm
from fdp.data import Dataset, MapData, num_train_samples
from fdp.errors import ConfigError, require
from fdp.optim.ema import check_ema_decay, ema
from fdp.plan import BucketPlan
from fdp.run.checkpoint import load
from fdp.run.config import EarlyStoppingConfig
from fdp.run.monitor import MODES, Monitor, Stopping, check_monitored, check_monitored_split, ranked, stopping_update
from fdp.state.train_state import TrainState
from fdp.update import zero

__all__ = [
    "LoopControls",
    "check_loop_settings",
    "check_max_time",
    "read_resumed",
    "run_steps",
    "steps_per_epoch",
]

MONITORED = EarlyStoppingConfig.monitor  # what early stopping and the best checkpoints watch unless told


# -- the run's length -------------------------------------------------------------------------
def steps_per_epoch(data: Dataset | MapData, global_batch_size: int) -> float:
    """Steps of ``global_batch_size`` samples in one pass over the training data.

    A text stream's pass is as many tokens as its characters (each step reads
    ``global_batch_size`` windows of ``block_size``).

    >>> from fdp.data import load_digits
    >>> steps_per_epoch(load_digits(), 64)
    22.46875
    """
    n = num_train_samples(data)
    if isinstance(data, Dataset) and data.is_text:
        return n / (global_batch_size * data.block_size)
    return n / global_batch_size


def run_steps(max_steps: int, max_epochs: int, data: Dataset | MapData, global_batch_size: int) -> int:
    """The run's last step: ``max_steps``, or fewer where ``max_epochs`` passes end sooner.

    A pass ends with the step that reads its last sample (that batch fills up from the
    next pass's order, as every batch crossing a pass does: ``fdp.data.global_batch``).

    >>> from fdp.data import load_digits
    >>> run_steps(300, 2, load_digits(), 64)  # 2 * 1438 samples: 44.9 steps
    45
    """
    if not max_epochs:
        return max_steps
    return min(max_steps, max(1, math.ceil(max_epochs * steps_per_epoch(data, global_batch_size) - 1e-9)))


def check_max_time(value: Any) -> float:
    """``max_time`` in seconds: a number, or ``[[DD:]HH:]MM:SS`` (Lightning's form); 0: no limit.

    >>> check_max_time("00:01:30:00"), check_max_time(90), check_max_time(0)
    (5400.0, 90.0, 0.0)
    >>> check_max_time("00:99:00")
    Traceback (most recent call last):
    ...
    ValueError: max_time='00:99:00': expected seconds >= 0 or DD:HH:MM:SS (e.g. 00:12:00:00 for 12 hours); its \
minutes field is 99, not below 60
    >>> check_max_time("1h")
    Traceback (most recent call last):
    ...
    ValueError: max_time='1h': expected seconds >= 0 or DD:HH:MM:SS (e.g. 00:12:00:00 for 12 hours)
    """
    what = "seconds >= 0 or DD:HH:MM:SS (e.g. 00:12:00:00 for 12 hours)"
    if isinstance(value, str) and ":" in value:
        parts = value.split(":")
        require(len(parts) <= 4 and all(p.strip().isdigit() for p in parts), "max_time", value, what)
        # Every field but the first counts within its unit (the first may be any number: 90:00 is 90 minutes).
        for part, (field, bound) in zip(reversed(parts[1:]), (("seconds", 60), ("minutes", 60), ("hours", 24))):
            require(int(part) < bound, "max_time", value, f"{what}; its {field} field is {part}, not below {bound}")
        return float(sum(int(p) * unit for p, unit in zip(reversed(parts), (1, 60, 3600, 86400))))
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    require(not isinstance(value, bool) and math.isfinite(seconds) and seconds >= 0, "max_time", value, what)
    return seconds


def check_loop_settings(tc: Any) -> None:
    """The settings of ``trainer`` (``tc``) this module uses, each refused in one line naming its key.

    >>> from fdp.run.config.compose import compose
    >>> check_loop_settings(compose("trainer.early_stopping.patience=-1").trainer)
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: trainer.early_stopping.patience=-1: expected an integer >= 0 (0: no early stopping)
    """

    def check(ok: bool, key: str, value: Any, what: str) -> None:
        require(ok, f"trainer.{key}", value, what, ConfigError)

    def named(key: str, rule: Any, value: Any) -> None:  # the rule names the setting as ``key``
        try:
            rule(value)
        except ValueError as error:
            raise ConfigError(f"trainer.{error}") from None

    check(tc.max_epochs >= 0, "max_epochs", tc.max_epochs, "an integer >= 0 (0: max_steps alone)")
    named("max_time", check_max_time, tc.max_time)
    named("ema_decay", check_ema_decay, tc.ema_decay)
    early = tc.early_stopping
    check(early.mode in MODES, "early_stopping.mode", early.mode, "auto, min or max")
    check(early.patience >= 0, "early_stopping.patience", early.patience, "an integer >= 0 (0: no early stopping)")
    check(early.min_delta >= 0, "early_stopping.min_delta", early.min_delta, "a number >= 0")
    check(
        not early.patience or tc.eval_every > 0,
        "early_stopping.patience",
        early.patience,
        "0 with trainer.eval_every=0 (early stopping decides at evaluations: set trainer.eval_every)",
    )
    check(tc.checkpoint_mode in MODES, "checkpoint_mode", tc.checkpoint_mode, "auto, min or max")
    check(tc.keep_best >= 0, "keep_best", tc.keep_best, "an integer >= 0 (0: no best checkpoints)")
    # A monitor named while what watches it is off would do nothing: said, not ignored.
    for key, name, switch, on in (
        ("early_stopping.monitor", early.monitor, "early_stopping.patience", early.patience),
        ("checkpoint_monitor", tc.checkpoint_monitor, "keep_best", tc.keep_best),
    ):
        check(bool(name), key, name, f"a metric of the evaluations (trainer.{switch}=0 turns it off)")
        check(
            on or name == MONITORED,
            key,
            name,
            f"trainer.{switch} >= 1 with a metric named (trainer.{switch}=0: off, the default)",
        )


class Verdict(NamedTuple):
    """What an evaluation decided: copy this step's checkpoint to the best ones; stop (why)."""

    keep_best: bool = False
    stop: str | None = None


# -- max_time -----------------------------------------------------------------------------------
class Deadline:
    """Rank 0's training clock against ``max_time``, agreed by every rank at the same step.

    Each step every rank all-reduces (max) rank 0's verdict on a gloo group of its own and
    reads the one issued a step before (long done by then): no step waits, and all ranks
    stop after the same step, one step after rank 0's clock ran out.
    """

    def __init__(self, limit_s: float, elapsed_s: float, comm: Comm):
        self.limit_s, self.before_s, self.started = limit_s, elapsed_s, time.perf_counter()
        self._group, self._pending = None, None
        self.join(comm)

    def join(self, comm: Comm) -> None:
        """Agree in the world of ``comm`` from now on (every rank calls it at the same point: a world that shrank or
        grew makes its group where a joining rank makes it, before the step's). The clock goes on: a rank that
        joins took the training time so far from the world's rank 0 (``LoopControls.payload``), and only the new
        rank 0's clock decides. A verdict in flight in the old world is dropped: rank 0 raises it again."""
        self.rank, self._group, self._pending = comm.rank, None, None
        if self.limit_s and comm.world_size > 1:
            from fdp._torch import group_timeout

            ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else list(range(comm.world_size))
            self._group = dist.new_group(ranks, timeout=group_timeout(), backend="gloo")

    def elapsed_s(self) -> float:
        """Training time so far, the invocations before this one included."""
        return self.before_s + time.perf_counter() - self.started

    def passed(self) -> bool:
        """Whether every rank stops after this step (call on every rank after every step)."""
        if not self.limit_s:
            return False
        mine = self.rank == 0 and self.elapsed_s() >= self.limit_s
        if self._group is None:
            return mine
        verdict = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            verdict = bool(flag.item())
        flag = torch.tensor([int(mine)], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return verdict

    def close(self, finished: bool = True) -> None:
        if self._pending is not None and finished:
            self._pending[0].wait()
        self._pending = None
        if self._group is not None:
            with contextlib.suppress(Exception):  # the world may be gone (a lost rank): nothing left to release
                dist.destroy_process_group(self._group)
            self._group = None


# -- the loop's controls ---------------------------------------------------------------------------
def agreed_params(state: TrainState) -> dict:
    """The params every rank holds alike, which the moving average follows: under an outer loop
    (``fdp.step.outer``) its anchor, the params of each fragment's last sync (between syncs each rank's
    own params differ); else the params.

    >>> agreed_params(TrainState(0, {"w": torch.ones(1)}, {}, (), (), None))["w"].tolist()
    [1.0]
    """
    return state.outer.anchor if state.outer else state.params


class LoopControls:
    """Everything above for one rank's loop: call ``stepped`` after each step, ``evaluated`` after each
    evaluation, ``payload`` for each checkpoint (on every rank), ``best_names`` for the best ones to keep.

    ``evaluates``: the data's splits, in ``fdp.data.SPLITS`` order (the first is scored during training);
    ``evaluated``: the metrics an evaluation during training adds to the record
    (``fdp.run.report.records.evaluated_names``; empty: the run does not evaluate): a monitored metric is checked
    against both before step 1;
    ``resumed``: the ``loop`` and ``ema`` entries of the checkpoint the run resumes from (``read_resumed``);
    ``end_step``: the run's last step (``run_steps``), whatever step this invocation stops at. ``shard``: the comm
    the state's slices are split over (the update's: a node's under hybrid sharding; by default ``comm``).
    """

    def __init__(
        self,
        tc: Any,
        comm: Comm,
        plan: BucketPlan,
        state: TrainState,
        evaluates: tuple,
        evaluated: tuple[str, ...],
        end_step: int,
        resumed: dict | None = None,
        shard: Comm | None = None,
    ):
        self.comm, self.plan = comm, plan
        self.shard = shard or comm  # at stage 3 the average is sliced as the params are
        self.eval_every, self.end_step = tc.eval_every, end_step
        early = tc.early_stopping
        self.early = Monitor.of(early.monitor, early.mode, early.min_delta) if early.patience else None
        self.patience = early.patience
        self.best_by = Monitor.of(tc.checkpoint_monitor, tc.checkpoint_mode) if tc.keep_best else None
        self.keep = tc.keep_best
        # Checkpoints then hold what an evaluation decides, so the loop evaluates before it saves.
        self.watches = self.early is not None or self.best_by is not None
        for setting, monitor in (
            ("trainer.early_stopping.monitor", self.early),
            ("trainer.checkpoint_monitor", self.best_by),
        ):
            if monitor is not None:
                check_monitored_split(setting, monitor.name, evaluates)
                check_monitored(setting, monitor.name, evaluated)
        loop = (resumed or {}).get("loop") or {}
        self.stopping = Stopping(loop.get("stopping_best"), int(loop.get("stopping_waited", 0)))
        self.best = tuple((float(v), int(s)) for v, s in loop.get("best", ()))
        self.deadline_s = check_max_time(tc.max_time)
        self.deadline = Deadline(self.deadline_s, float(loop.get("elapsed_s", 0.0)), comm)
        self.ema = ema(tc.ema_decay) if tc.ema_decay else None
        self.average = self._resumed_average((resumed or {}).get("ema"), state) if self.ema else None
        self._before = self.average  # the average of the step before (a world that shrinks may go back to it)
        self.stopped: str | None = None  # why the loop ended early (a line for the log)

    def _resumed_average(self, saved: dict | None, state: TrainState) -> dict:
        if saved is None:  # a new run, or one that turns the average on when resumed
            return self.ema.init(agreed_params(state))
        if zero.params_sharded(state.params, self.plan):  # this rank's slices of the whole average
            whole = TrainState(0, saved, {}, (), (), state.rng)
            return self.ema.init(zero.shard_state(whole, self.plan, self.shard, stage=3).params)
        return self.ema.init({name: saved[name].to(p.device) for name, p in state.params.items()})

    def ended_before(self) -> str | None:
        """Why a resumed run has nothing left to do (it had stopped early), or ``None``."""
        if self.early is not None and self.stopping.waited >= self.patience:
            return self._early_stop_line()
        if self.deadline_s and self.deadline.before_s >= self.deadline_s:
            return f"max_time={self.deadline_s:g} s already spent ({self.deadline.before_s:.1f} s)"
        return None

    def stepped(self, state: TrainState) -> str | None:
        """After each step on every rank: update the average; why to stop now (max_time), or ``None``."""
        if self.ema is not None:
            self._before, self.average = self.average, self.ema.update(self.average, agreed_params(state))
        if self.deadline.passed():
            return f"max_time={self.deadline_s:g} s reached after {self.deadline.elapsed_s():.1f} s of training"
        return None

    def join(self, comm: Comm) -> None:
        """Go on in the world of ``comm`` (one that shrank or grew: ``fdp.run.loop``), the training time with it."""
        self.comm = comm
        self.deadline.join(comm)

    def back(self) -> None:
        """Undo the last step's update of the average (the world went back to the step before: ``fdp.procs.shrink``)."""
        self.average = self._before

    @property
    def stopped_by(self) -> str | None:
        """The setting that ended the run before its last step (the summary's ``stopped``), or ``None``."""
        if not self.stopped:
            return None
        return "early_stopping" if self.stopped.startswith("early stopping") else "max_time"

    def scheduled(self, step: int) -> bool:
        """Whether every run of these settings evaluates at ``step`` (see ``evaluated``)."""
        return bool(self.eval_every and step % self.eval_every == 0 or step == self.end_step)

    def evaluated(self, step: int, record: dict | None) -> Verdict:
        """After each step: with an evaluation's ``record`` (the same on every rank), rank it and decide.

        Only the evaluations every run of these settings makes count: not the one closing an
        invocation that stops early to be resumed (``trainer.stop_at``), or a resumed run would
        decide on one evaluation more than the uninterrupted one.
        """
        if record is None or not self.scheduled(step):
            return Verdict()
        keep = False
        if self.best_by is not None:
            value = self.best_by.read(record, "trainer.checkpoint_monitor")
            self.best, keep = ranked(self.best, value, step, self.keep, self.best_by)
        stop = None
        if self.early is not None:
            self.stopping = stopping_update(
                self.stopping, self.early.read(record, "trainer.early_stopping.monitor"), self.early
            )
            if self.stopping.waited >= self.patience:
                stop = self._early_stop_line()
        return Verdict(keep, stop)

    def _early_stop_line(self) -> str:
        return (
            f"early stopping: {self.early.name} has not improved on {self.stopping.best:.6g} for "
            f"{self.stopping.waited} evaluations (trainer.early_stopping.patience={self.patience})"
        )

    def payload(self, step: int) -> dict:
        """The checkpoint's entries for the loop (call on every rank: at stage 3 the average is gathered)."""
        out: dict[str, Any] = {
            "loop": {
                "step": step,
                "elapsed_s": self.deadline.elapsed_s(),
                "stopping_best": self.stopping.best,
                "stopping_waited": self.stopping.waited,
                "best": [list(entry) for entry in self.best],
                "monitor": self.best_by.name if self.best_by else None,
            }
        }
        if self.average is not None:
            average = self.average
            if zero.params_sharded(average, self.plan):
                holder = TrainState(step, average, {}, (), (), torch.empty(0))
                average = zero.gather_state(holder, self.plan, self.shard, to=0).params
            out["ema"] = {name: t.detach().cpu() for name, t in average.items()}
        return out

    def best_names(self) -> dict[int, str] | None:
        """The best checkpoints ranked so far, by step, as ``checkpoints/best/`` names them
        (``step=<N>-<metric>=<value>``); ``None`` where the run keeps none (``trainer.keep_best=0``).

        The run's checkpoints keep them (``fdp.run.checkpoint.Checkpointer.keep_best``)."""
        if self.best_by is None:
            return None
        return {step: f"step={step}-{self.best_by.name}={value:.6g}" for value, step in self.best}

    def close(self, finished: bool = True) -> None:
        self.deadline.close(finished)


def read_resumed(path: Path, comm: Comm) -> dict:
    """The ``loop`` and ``ema`` entries of the checkpoint at ``path`` (rank 0 reads; every rank gets them)."""
    box = [None]
    if comm.rank == 0:
        payload = load(path, mmap=True)
        box = [{key: payload.get(key) for key in ("loop", "ema", "callbacks")}]  # and fdp.run.callbacks' states
        if box[0]["ema"] is not None:
            box[0]["ema"] = {name: t.clone() for name, t in box[0]["ema"].items()}  # off the mapped file
    if comm.world_size > 1:
        dist.broadcast_object_list(box, group=comm.group, group_src=0)
    return box[0]
