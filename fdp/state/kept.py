"""The state before the step in flight, kept for a world that may go back to it (``fdp.procs.shrink``).

A world that shrinks goes on from the last step every survivor completed: a survivor one step
ahead goes back to the state before that step, and one whose step failed part way (an early
bucket stepped in place, a slice gathered) goes back to the state that step began with. A step
that donates its state (``make_train_step(..., donate=True)``: the fused optimizer kernels, in
place) leaves neither intact, so ``KeptState`` copies the state's tensors into buffers of its own
before each step: one multi-tensor copy, into the same buffers every step (no allocation), which
costs less than a step that keeps its input intact by making new tensors (``donate=False``).
A step that does not donate leaves its input intact: the state itself is kept, nothing copied.

>>> from fdp import functionalize, init_train_state, sgd
>>> model, params, buffers = functionalize(torch.nn.Linear(2, 1))
>>> state = init_train_state(params, buffers, sgd(0.1))
>>> was, kept = state.params["weight"].clone(), KeptState(copies=True)
>>> kept.keep(state)
>>> _ = state.params["weight"].add_(1.0)  # a donated step writes over the state
>>> before = kept.take()
>>> torch.equal(before.params["weight"], was), before.step
(True, 0)
"""

from __future__ import annotations

import torch

from fdp._torch import foreach, tree_flatten, tree_unflatten
from fdp.state.train_state import TrainState

__all__ = ["KeptState"]


class KeptState:
    """The state before the step in flight: ``keep(state)`` before each step, ``take()`` to go back to it.

    ``copies``: whether the step donates its state (then its tensors are copied into buffers
    refreshed in place each step; else the state itself is held). The buffers are made at the
    first ``keep`` after ``forget`` (or ``take``, which hands them over): call ``forget`` when the
    state's layout changes (another world: its slices are split again).
    """

    def __init__(self, copies: bool):
        self.copies = copies
        self._state: TrainState | None = None
        self._buffers: list[torch.Tensor] | None = None

    def keep(self, state: TrainState) -> None:
        """Keep ``state``, the state the next step begins from."""
        if not self.copies:
            self._state = state
            return
        leaves, spec = tree_flatten(state)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if self._buffers is None:
            self._buffers = [tensor.detach().clone() for tensor in tensors]
        else:
            foreach.copy_(self._buffers, tensors)
        copies = iter(self._buffers)
        self._state = tree_unflatten([next(copies) if isinstance(x, torch.Tensor) else x for x in leaves], spec)

    @property
    def step(self) -> int | None:
        """The step the kept state completed (``None``: nothing kept since the last ``forget`` or ``take``)."""
        return None if self._state is None else self._state.step

    def take(self) -> TrainState:
        """The kept state, handed over: its buffers are the caller's now (the next ``keep`` makes new ones)."""
        state = self._state
        if state is None:
            raise RuntimeError("no state kept: keep(state) before the step")
        self.forget()
        return state

    def forget(self) -> None:
        """Drop what is kept (the world changed, or the state went back)."""
        self._state, self._buffers = None, None

    def __repr__(self) -> str:
        return f"KeptState(copies={self.copies}, step={self.step})"
