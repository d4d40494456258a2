"""The run's callbacks as the loop calls them, and their state in checkpoints (``Callbacks``), and what a Python
caller gives checked (``check_given``). What a callback may define and is shown: ``fdp.run.callbacks``.

>>> from fdp import Callback
>>> from fdp.comm import Comm
>>> class CountSteps(Callback):
...     def __init__(self):
...         self.steps = 0
...     def on_step_end(self, event):
...         self.steps += 1
...     def state_dict(self):
...         return {"steps": self.steps}
...     def load_state_dict(self, state):
...         self.steps = state["steps"]
>>> callbacks = Callbacks([CountSteps()], run_dir=".")
>>> state = TrainState(1, {"w": torch.zeros(2)}, {}, (), (), torch.empty(0))
>>> callbacks.step_end(Comm(), state, {"loss": torch.tensor(0.5)})
>>> callbacks.payload(Comm())["callbacks"]["0:fdp.run.callbacks.calls.CountSteps"]["states"]
[{'steps': 1}]
>>> class Doubles(Callback):
...     def on_step_end(self, event):
...         event.state.params["w"].mul_(2)
>>> Callbacks([Doubles()], run_dir=".").step_end(Comm(), state, {})  # doctest: +NORMALIZE_WHITESPACE
Traceback (most recent call last):
...
fdp.run.callbacks.base.CallbackError: callback 'fdp.run.callbacks.calls.Doubles' failed at step_end (step 1):
it wrote to state.params['w'] in place; a callback only reads (clone what it changes)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import torch
import torch.distributed as dist

from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.plan import BucketPlan
from fdp.run.callbacks.base import (
    EVENTS,
    EXPECTED,
    CallbackError,
    LoopEvent,
    defines,
    first_line,
    name_of,
    not_a_callback,
)
from fdp.run.callbacks.specs import build_callbacks
from fdp.run.callbacks.view import frozen, written
from fdp.state.train_state import TrainState
from fdp.update import zero

__all__ = ["Callbacks", "check_given"]


def check_given(callbacks: Sequence, path: str = "callbacks") -> None:
    """Refuse in one line what a Python caller gives as callbacks that is not one.

    >>> from fdp import Callback
    >>> check_given([Callback, Callback()])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: callbacks[0]: the class Callback (an instance is called for: Callback(...));
    expected a callback (an object with any of on_step_end, on_evaluation_end, on_save, on_run_end: fdp.Callback)
    """
    for i, callback in enumerate(callbacks):
        what = not_a_callback(callback)
        if what is not None:
            raise ConfigError(f"{path}[{i}]: {what}; {EXPECTED}")


def _cloned(tree: Any) -> Any:
    """``tree`` with each tensor a copy of its own (off a mapped checkpoint file, out of reach of another rank)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(v) for v in tree)
    return tree


class Callbacks:
    """The run's callbacks, called by the loop at its points (``step_end``, ``evaluation_end``, ``saved``,
    ``run_end``), on every rank: each runs on the ranks it declares.

    ``callbacks``: objects, or ``(name, object)`` pairs (a config's, named by ``_target_``); ``plan``: the run's
    bucket plan (for ``whole_params`` at ZeRO stage 3).
    """

    def __init__(self, callbacks: Sequence = (), run_dir: str | Path = ".", plan: BucketPlan | None = None):
        named = [c if isinstance(c, tuple) else (name_of(c), c) for c in callbacks]
        self.named = [(f"{i}:{name}", name, c) for i, (name, c) in enumerate(named)]
        self.run_dir, self.plan = Path(run_dir), plan

    @classmethod
    def of(cls, specs: Any, given: Sequence, run_dir: str | Path, plan: BucketPlan | None) -> Callbacks:
        """The config's callbacks (``trainer.callbacks``), then those given from Python."""
        return cls([*build_callbacks(specs), *given], run_dir, plan)

    def _on(self, rank: int, method: str) -> list:
        return [
            (n, c) for _, n, c in self.named if (rank == 0 or getattr(c, "every_rank", False)) and defines(c, method)
        ]

    def wants(self, event: str, rank: int) -> bool:
        """Whether a callback of this rank hears ``event``."""
        return bool(self._on(rank, EVENTS[event]))

    @property
    def evaluate_first(self) -> bool:
        """Whether a callback keeps state and hears evaluations: a checkpoint must then hold its state after the
        step's evaluation (the loop evaluates before it saves)."""
        return any(defines(c, "on_evaluation_end") and defines(c, "state_dict") for _, _, c in self.named)

    def _call(self, event: str, comm: Comm, state: TrainState, metrics: Mapping, checkpoint: Path | None) -> None:
        listening = self._on(comm.rank, EVENTS[event])
        if not listening:
            return
        seen: list = []
        view = frozen(state, seen)
        shown = frozen(dict(metrics), seen)
        sharded = self.plan is not None and zero.params_sharded(state.params, self.plan)
        for name, callback in listening:
            whole = self._whole(state, comm, getattr(callback, "every_rank", False)) if sharded else None
            shown_to = LoopEvent(state.step, shown, view, self.run_dir, comm.rank, comm.world_size, checkpoint, whole)
            try:
                getattr(callback, EVENTS[event])(shown_to)
            except Exception as error:
                raise self._failed(name, event, state.step, f"{type(error).__name__}: {first_line(error)}") from error
            where = written(seen, {"state": state, "metrics": metrics})
            if where is not None:
                raise self._failed(
                    name,
                    event,
                    state.step,
                    f"it wrote to {where} in place; a callback only reads (clone what it changes)",
                )

    def _whole(self, state: TrainState, comm: Comm, every_rank: bool) -> Callable[[], Mapping]:
        def whole() -> Mapping:
            if comm.world_size > 1 and not every_rank:
                raise ValueError(
                    "whole_params() gathers the params from every rank at ZeRO stage 3: call it from a callback "
                    "that runs on every rank (every_rank = True), on every rank"
                )
            return MappingProxyType(dict(zero.whole_params(state, self.plan, comm)))

        return whole

    @staticmethod
    def _failed(name: str, event: str, step: int, why: str) -> CallbackError:
        return CallbackError(f"callback {name!r} failed at {event} (step {step}): {why}")

    def step_end(self, comm: Comm, state: TrainState, metrics: Mapping) -> None:
        """After each step: ``metrics`` are this rank's, as the step returned them."""
        self._call("step_end", comm, state, metrics, None)

    def evaluation_end(self, comm: Comm, state: TrainState, record: Mapping) -> None:
        """After an evaluation: ``record`` is rank 0's, on every rank."""
        self._call("evaluation_end", comm, state, record, None)

    def saved(self, comm: Comm, state: TrainState, checkpoint: Path | None) -> None:
        """Once the checkpoint of ``state`` at ``checkpoint`` is complete."""
        self._call("save", comm, state, {}, checkpoint)

    def run_end(self, comm: Comm, state: TrainState, summary: Mapping) -> None:
        """Once the loop is done: ``summary`` is this rank's."""
        self._call("run_end", comm, state, summary, None)

    # -- their state in checkpoints ---------------------------------------------------------------
    def _state(self, name: str, callback: Any) -> Any:
        try:
            state = callback.state_dict()
        except Exception as error:
            raise CallbackError(
                f"callback {name!r} failed at state_dict: {type(error).__name__}: {first_line(error)}"
            ) from error
        odd = _not_plain(state, "state_dict()")
        if odd is not None:  # it would save, but not load (checkpoints load with weights_only=True)
            raise CallbackError(
                f"callback {name!r} failed at state_dict: {odd}; expected plain values (dict, list, tuple, str, "
                "int, float, bool, None) and tensors"
            )
        return state

    def payload(self, comm: Comm) -> dict:
        """The checkpoint's ``callbacks`` entry (call on every rank: an ``every_rank`` callback's state is
        gathered from each), by callback: ``{"every_rank": ..., "states": [rank 0's, ...]}``."""
        kept = [(k, n, c) for k, n, c in self.named if defines(c, "state_dict")]
        if not kept:
            return {}
        entry = {}
        for key, name, callback in kept:
            every = bool(getattr(callback, "every_rank", False))
            mine = self._state(name, callback) if every or comm.rank == 0 else None
            states = [mine]
            if every and comm.world_size > 1:
                states = [None] * comm.world_size if comm.rank == 0 else None
                dist.gather_object(mine, states, group=comm.group, group_dst=0)
            entry[key] = {"every_rank": every, "states": states}
        return {"callbacks": entry}

    def restore(self, saved: Mapping | None, comm: Comm) -> None:
        """Hand each callback its state from a checkpoint's ``callbacks`` entry (``payload``); a callback with
        none saved (new to this run, or another at its place in the list) starts afresh."""
        for key, name, callback in self.named:
            entry = (saved or {}).get(key)
            every = bool(getattr(callback, "every_rank", False))
            if entry is None or not defines(callback, "load_state_dict") or not (every or comm.rank == 0):
                continue
            states = entry["states"]
            state = states[comm.rank] if len(states) == comm.world_size else states[0]
            if state is None:
                continue
            try:
                callback.load_state_dict(_cloned(state))
            except Exception as error:
                raise CallbackError(
                    f"callback {name!r} failed at load_state_dict: {type(error).__name__}: {first_line(error)}"
                ) from error


def _not_plain(tree: Any, path: str) -> str | None:
    """Where ``tree`` holds something other than plain values and tensors (``None``: nowhere).

    >>> _not_plain({"best": 0.5, "steps": [1, 2], "at": object()}, "state")
    "state['at'] is of type object"
    """
    if tree is None or isinstance(tree, (str, int, float, bool, torch.Tensor)):
        return None
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = enumerate(tree)
    else:
        return f"{path} is of type {type(tree).__name__}"
    return next((odd for k, v in items if (odd := _not_plain(v, f"{path}[{k!r}]")) is not None), None)
