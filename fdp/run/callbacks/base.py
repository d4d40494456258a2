"""What a loop callback is: ``Callback`` (its methods, one per event), what it is shown (``LoopEvent``) and the
error that ends a run when one fails (``CallbackError``). The run's callbacks and the loop's calls:
``fdp.run.callbacks.calls``.

>>> name_of(Callback()), defines(Callback(), "on_save")
('fdp.run.callbacks.base.Callback', False)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

from fdp.state.train_state import TrainState

__all__ = ["EVENTS", "EXPECTED", "Callback", "CallbackError", "LoopEvent", "defines", "name_of", "not_a_callback"]

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
    """What a callback is shown at an event (see ``fdp.run.callbacks``); every field is read-only.

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
    """A callback that does nothing: subclass it and override what you need (see ``fdp.run.callbacks``)."""

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


def defines(callback: Any, method: str) -> bool:
    """Whether ``callback`` has ``method`` of its own (not ``Callback``'s, which does nothing)."""
    found = getattr(type(callback), method, None)
    return callable(found) and found is not getattr(Callback, method, None)


def name_of(callback: Any) -> str:
    """How errors name a callback given as an object: its class's dotted path.

    >>> name_of(Callback())
    'fdp.run.callbacks.base.Callback'
    """
    kind = type(callback)
    return f"{kind.__module__}.{kind.__qualname__}"


def not_a_callback(made: Any) -> str | None:
    """What ``made`` is, where it is not a callback (an object with any of the events' methods), or ``None``."""
    if inspect.isclass(made):
        return f"the class {made.__name__} (an instance is called for: {made.__name__}(...))"
    if not any(callable(getattr(made, method, None)) for method in EVENTS.values()):
        return f"a {type(made).__name__}"
    return None


EXPECTED = f"expected a callback (an object with any of {', '.join(EVENTS.values())}: fdp.Callback)"


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, for a one-line ``CallbackError``."""
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
