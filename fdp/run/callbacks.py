"""Your own code in the loop: callbacks the loop calls at its points, each with a read-only view of the run.

A callback is an object with any of these methods (``Callback`` has them all, doing nothing):

* ``on_step_end(event)``: after every step, with the step's metrics (this rank's: ``loss`` is its share's);
* ``on_evaluation_end(event)``: after each evaluation, with its record (rank 0's on every rank: ``val_loss``...);
  the evaluations every run of the settings makes (not the one closing a ``trainer.stop_at`` invocation);
* ``on_save(event)``: once a checkpoint is complete, ``event.checkpoint`` its path (with the whole-file format
  only rank 0's is known: ``None`` on the others; an asynchronous sharded write is waited for first);
* ``on_run_end(event)``: once the loop is done (the last step, a stop or a signal), the summary as its metrics.

Where it runs: rank 0 only, unless it declares ``every_rank = True``. What it keeps across a resume:
``state_dict()`` (plain values and tensors) is saved in every checkpoint, either format, and handed back to
``load_state_dict(state)`` on resume, so a resumed run's callback goes on as the uninterrupted one's (an
``every_rank`` callback's by rank; on a world of another size every rank gets rank 0's). A checkpoint holds
the state from before its own ``on_save``. A run with a callback that keeps state and hears evaluations
evaluates a step before it checkpoints it, as early stopping's does (``fdp.run.loop``).

Chosen from the config, as models and hooks are (``fdp.targets``):
``trainer.callbacks=[{_target_: my_pkg.callbacks.Log, every: 10}]``, or from Python:
``fdp.run.trainer.run(cfg, run_dir, callbacks=[Log(every=10)])`` (a local world pickles them into its ranks).

What a callback sees (``LoopEvent``) is read-only: ``state`` is this rank's ``TrainState`` with its mappings
frozen (``MappingProxyType``) and its lists made tuples; its tensors are the loop's own, and an in-place write
to one of them or to a metric (caught by the tensors' version counters, what autograd uses) ends the run as an
exception does. Writes that bypass the counters (``tensor.data``, a numpy view) go unseen: don't make them.
The loop updates the tensors in place at the next step: ``clone()`` what you keep. At ZeRO stage 3
``state.params`` are this rank's flat slices by bucket (``bucket0``...); ``event.whole_params()`` gathers them
whole by name (a collective: call it on every rank, from an ``every_rank`` callback). A callback that raises
ends the run with one line, ``CallbackError``, naming it and the event (the recipe: exit 2; the traceback
goes to ``train.log``).

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
>>> callbacks.payload(Comm())["callbacks"]["0:fdp.run.callbacks.CountSteps"]["states"]
[{'steps': 1}]
>>> class Doubles(Callback):
...     def on_step_end(self, event):
...         event.state.params["w"].mul_(2)
>>> Callbacks([Doubles()], run_dir=".").step_end(Comm(), state, {})  # doctest: +NORMALIZE_WHITESPACE
Traceback (most recent call last):
...
fdp.run.callbacks.CallbackError: callback 'fdp.run.callbacks.Doubles' failed at step_end (step 1):
it wrote to state.params['w'] in place; a callback only reads (clone what it changes)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import torch
import torch.distributed as dist

from fdp.comm import Comm
from fdp.errors import ConfigError
from fdp.plan import BucketPlan
from fdp.state.train_state import TrainState
from fdp.targets import build, locate
from fdp.update import zero

__all__ = ["Callback", "CallbackError", "Callbacks", "LoopEvent", "check_callbacks", "check_given"]

# The events by name (as errors name them) and the method each calls.
EVENTS = {
    "step_end": "on_step_end",
    "evaluation_end": "on_evaluation_end",
    "save": "on_save",
    "run_end": "on_run_end",
}


class CallbackError(Exception):
    """A callback failed (raised, or wrote to what it was shown); the message names it and the event.

    Not a ``RuntimeError``: the loop reads those as a lost rank's failed collective.
    """


@dataclasses.dataclass(frozen=True)
class LoopEvent:
    """What a callback is shown at an event (see the module docstring); every field is read-only.

    ``step``: the state's step; ``metrics``: the step's metrics, the evaluation's record, or the summary;
    ``state``: this rank's ``TrainState``; ``run_dir``: the run directory; ``checkpoint``: at ``save``, the
    checkpoint's path; ``rank``, ``world_size``: this rank's place in the world.
    """

    step: int
    metrics: Mapping[str, Any]
    state: TrainState
    run_dir: Path
    rank: int = 0
    world_size: int = 1
    checkpoint: Path | None = None
    _whole: Callable[[], Mapping] | None = dataclasses.field(default=None, repr=False)

    def whole_params(self) -> Mapping[str, torch.Tensor]:
        """The params whole, by name: at ZeRO stage 3 gathered from every rank's slices (a collective: call it on
        every rank, from an ``every_rank`` callback); at the other stages ``state.params`` themselves."""
        return self._whole() if self._whole is not None else self.state.params


class Callback:
    """A callback that does nothing: subclass it and override what you need (see the module docstring)."""

    every_rank: bool = False

    def on_step_end(self, event: LoopEvent) -> None:
        pass

    def on_evaluation_end(self, event: LoopEvent) -> None:
        pass

    def on_save(self, event: LoopEvent) -> None:
        pass

    def on_run_end(self, event: LoopEvent) -> None:
        pass

    def state_dict(self) -> dict | None:
        """What to checkpoint (plain values and tensors), or ``None``: nothing."""
        return None

    def load_state_dict(self, state: dict) -> None:
        pass


def _defines(callback: Any, method: str) -> bool:
    """Whether ``callback`` has ``method`` of its own (not ``Callback``'s, which does nothing)."""
    found = getattr(type(callback), method, None)
    return callable(found) and found is not getattr(Callback, method, None)


def name_of(callback: Any) -> str:
    """How errors name a callback given as an object: its class's dotted path.

    >>> name_of(Callback())
    'fdp.run.callbacks.Callback'
    """
    kind = type(callback)
    return f"{kind.__module__}.{kind.__qualname__}"


# -- from the config ------------------------------------------------------------------------------
def _specs(specs: Any, path: str) -> list[dict]:
    if specs is None:
        return []
    if not isinstance(specs, Sequence) or isinstance(specs, str):
        raise ConfigError(
            f"{path}={specs!r}: expected a list of callbacks, such as [{{_target_: my_pkg.callbacks.Log}}]"
        )
    out = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping) or spec.get("_target_", "???") == "???":
            raise ConfigError(
                f"{path}[{i}]={spec!r}: expected a mapping with a _target_ (the dotted path to a callback class "
                "or factory) and its settings, such as {_target_: my_pkg.callbacks.Log, every: 10}"
            )
        out.append({str(k): v for k, v in spec.items()})
    return out


def check_callbacks(specs: Any, path: str = "trainer.callbacks") -> None:
    """Refuse, before anything runs, a callback spec whose ``_target_`` does not import, is not a callback class,
    or does not take its settings; nothing is built.

    >>> check_callbacks([{"_target_": "fdp.run.callbacks.Callback", "every": 3}])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: trainer.callbacks[0]._target_='fdp.run.callbacks.Callback':
    does not take every=3 (got an unexpected keyword argument 'every')
    """
    for i, spec in enumerate(_specs(specs, path)):
        setting = f"{path}[{i}]._target_"
        target = locate(setting, spec["_target_"])
        settings = {k: v for k, v in spec.items() if not k.startswith("_")}
        if inspect.isclass(target) and not any(hasattr(target, method) for method in EVENTS.values()):
            raise ConfigError(f"{setting}={spec['_target_']!r}: {_EXPECTED}")
        try:
            inspect.signature(target).bind(**settings)
        except TypeError as error:
            given = ", ".join(f"{k}={v!r}" for k, v in settings.items())
            raise ConfigError(f"{setting}={spec['_target_']!r}: does not take {given} ({error})") from None
        except ValueError:  # no signature to inspect (a builtin): the build says
            pass


def _not_a_callback(made: Any) -> str | None:
    """What ``made`` is, where it is not a callback (an object with any of the events' methods), or ``None``."""
    if inspect.isclass(made):
        return f"the class {made.__name__} (an instance is called for: {made.__name__}(...))"
    if not any(callable(getattr(made, method, None)) for method in EVENTS.values()):
        return f"a {type(made).__name__}"
    return None


_EXPECTED = f"expected a callback (an object with any of {', '.join(EVENTS.values())}: fdp.Callback)"


def check_given(callbacks: Sequence, path: str = "callbacks") -> None:
    """Refuse in one line what a Python caller gives as callbacks that is not one.

    >>> check_given([Callback, Callback()])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    fdp.errors.ConfigError: callbacks[0]: the class Callback (an instance is called for: Callback(...));
    expected a callback (an object with any of on_step_end, on_evaluation_end, on_save, on_run_end: fdp.Callback)
    """
    for i, callback in enumerate(callbacks):
        what = _not_a_callback(callback)
        if what is not None:
            raise ConfigError(f"{path}[{i}]: {what}; {_EXPECTED}")


def build_callbacks(specs: Any, path: str = "trainer.callbacks") -> list[tuple[str, Any]]:
    """The callbacks ``specs`` name, each with its ``_target_`` (how errors name it)."""
    made = []
    for i, spec in enumerate(_specs(specs, path)):
        callback = build(f"{path}[{i}]", {"name": "custom", **spec})
        what = _not_a_callback(callback)
        if what is not None:
            raise ConfigError(f"{path}[{i}]._target_={spec['_target_']!r}: returned {what}; {_EXPECTED}")
        made.append((str(spec["_target_"]), callback))
    return made


# -- the read-only view ---------------------------------------------------------------------------
def _frozen(tree: Any, seen: list) -> Any:
    """``tree`` with its mappings frozen and its lists made tuples; each tensor noted in ``seen`` with its
    version, to tell a write after the call."""
    if isinstance(tree, torch.Tensor):
        seen.append((tree, tree._version))
        return tree
    if isinstance(tree, (int, float, str, type(None))):
        return tree
    if isinstance(tree, dict):
        return MappingProxyType({k: _frozen(v, seen) for k, v in tree.items()})
    if isinstance(tree, tuple):
        if hasattr(tree, "_fields"):  # a NamedTuple: its own type
            return type(tree)(*(_frozen(v, seen) for v in tree))
        return tuple(_frozen(v, seen) for v in tree)
    if isinstance(tree, (list, Mapping)):
        return _frozen(dict(tree) if isinstance(tree, Mapping) else tuple(tree), seen)
    return tree


def _path_to(tree: Any, target: torch.Tensor, path: str) -> str | None:
    """Where ``target`` is in ``tree`` (``state.params['w']``), for the message; ``None`` if it is not."""
    if tree is target:
        return path
    if isinstance(tree, Mapping):
        items = ((f"{path}[{k!r}]", v) for k, v in tree.items())
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):
        items = ((f"{path}.{f}", v) for f, v in zip(tree._fields, tree))
    elif isinstance(tree, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(tree))
    else:
        return None
    return next((found for p, v in items if (found := _path_to(v, target, p)) is not None), None)


def _written(seen: list, shown: dict[str, Any]) -> str | None:
    """Where a tensor noted in ``seen`` was written since (its version moved), among the ``shown`` trees."""
    tensor = next((t for t, version in seen if t._version != version), None)
    if tensor is None:
        return None
    return next((p for name, tree in shown.items() if (p := _path_to(tree, tensor, name)) is not None), "a tensor")


def _cloned(tree: Any) -> Any:
    """``tree`` with each tensor a copy of its own (off a mapped checkpoint file, out of reach of another rank)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _cloned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(v) for v in tree)
    return tree


# -- the loop's side ------------------------------------------------------------------------------
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
            (n, c) for _, n, c in self.named if (rank == 0 or getattr(c, "every_rank", False)) and _defines(c, method)
        ]

    def wants(self, event: str, rank: int) -> bool:
        """Whether a callback of this rank hears ``event``."""
        return bool(self._on(rank, EVENTS[event]))

    @property
    def evaluate_first(self) -> bool:
        """Whether a callback keeps state and hears evaluations: a checkpoint must then hold its state after the
        step's evaluation (the loop evaluates before it saves)."""
        return any(_defines(c, "on_evaluation_end") and _defines(c, "state_dict") for _, _, c in self.named)

    def _call(self, event: str, comm: Comm, state: TrainState, metrics: Mapping, checkpoint: Path | None) -> None:
        listening = self._on(comm.rank, EVENTS[event])
        if not listening:
            return
        seen: list = []
        view = _frozen(state, seen)
        shown = _frozen(dict(metrics), seen)
        sharded = self.plan is not None and zero.params_sharded(state.params, self.plan)
        for name, callback in listening:
            whole = self._whole(state, comm, getattr(callback, "every_rank", False)) if sharded else None
            shown_to = LoopEvent(state.step, shown, view, self.run_dir, comm.rank, comm.world_size, checkpoint, whole)
            try:
                getattr(callback, EVENTS[event])(shown_to)
            except Exception as error:
                raise self._failed(name, event, state.step, f"{type(error).__name__}: {_first_line(error)}") from error
            written = _written(seen, {"state": state, "metrics": metrics})
            if written is not None:
                raise self._failed(
                    name,
                    event,
                    state.step,
                    f"it wrote to {written} in place; a callback only reads (clone what it changes)",
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
                f"callback {name!r} failed at state_dict: {type(error).__name__}: {_first_line(error)}"
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
        kept = [(k, n, c) for k, n, c in self.named if _defines(c, "state_dict")]
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
            if entry is None or not _defines(callback, "load_state_dict") or not (every or comm.rank == 0):
                continue
            states = entry["states"]
            state = states[comm.rank] if len(states) == comm.world_size else states[0]
            if state is None:
                continue
            try:
                callback.load_state_dict(_cloned(state))
            except Exception as error:
                raise CallbackError(
                    f"callback {name!r} failed at load_state_dict: {type(error).__name__}: {_first_line(error)}"
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
