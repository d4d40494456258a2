"""The state before the step in flight, kept for a world that may go back to it (``fdp.procs.shrink``).

A world that shrinks goes on from the last step every survivor completed: a survivor one step
ahead goes back to the state before that step, and one whose step failed part way (an early
bucket stepped in place, a slice gathered) goes back to the state that step began with. A step
that donates its state (``make_train_step(..., donate=True)``: the fused optimizer kernels, in
place) leaves neither intact, so ``KeptState`` copies the state's tensors into buffers of its own
before each step: one multi-tensor copy of their storages, into the same buffers every step (no
allocation), which costs less than a step that keeps its input intact by making new tensors
(``donate=False``).
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

from typing import Any

import torch

from fdp._torch import foreach, on_storage, tree_flatten, tree_unflatten
from fdp.state.train_state import TrainState

__all__ = ["KeptState"]


class KeptState:
    """The state before the step in flight: ``keep(state)`` before each step, ``take()`` to go back to it.

    ``copies``: whether the step donates its state (then the storages of its tensors are copied into
    buffers refreshed in place each step, so that the state taken back is laid out as the state was:
    params that were views of one flat buffer per bucket are views of one copy of it, as the step
    function's update expects; else the state itself is held). The buffers are made at the first
    ``keep`` after ``forget`` or ``take`` (which hands them over), and again where the state's storages
    changed (another world: its slices split again).
    """

    def __init__(self, copies: bool):
        self.copies = copies
        self._state: TrainState | None = None
        self._buffers: list[torch.Tensor] = []
        # What the last keep saw of the state: its leaves, their tree, and each tensor leaf's storage (by index).
        self._kept: tuple[list, Any, list[int | None]] | None = None
        self._sources: dict[int, torch.Tensor] = {}  # the last keep's storages as bytes, by address

    def keep(self, state: TrainState) -> None:
        """Keep ``state``, the state the next step begins from."""
        self._state = state
        if not self.copies:
            return
        leaves, spec = tree_flatten(state)
        sources: list[torch.Tensor] = []  # each storage's bytes, once however many tensors view it
        where: list[int | None] = []
        seen: dict[int, int] = {}
        # A donated state's tensors keep their storages from step to step: their byte views are made once (held,
        # so that no other storage takes the address while it is a key).
        known, self._sources = self._sources, {}
        for leaf in leaves:
            address = leaf.untyped_storage().data_ptr() if isinstance(leaf, torch.Tensor) else 0
            if not address:  # not a tensor, or one without data (nothing of it to write over): kept as it is
                where.append(None)
                continue
            index = seen.setdefault(address, len(sources))
            if index == len(sources):
                source = known.get(address)
                if source is None:
                    source = on_storage(leaf, torch.uint8, 0, (leaf.untyped_storage().nbytes(),))
                sources.append(source)
                self._sources[address] = source
            where.append(index)
        if len(self._buffers) != len(sources) or any(b.numel() != s.numel() for b, s in zip(self._buffers, sources)):
            self._buffers = [source.clone() for source in sources]
        else:
            foreach.copy_(self._buffers, sources)
        self._kept = (leaves, spec, where)

    @property
    def step(self) -> int | None:
        """The step the kept state completed (``None``: nothing kept since the last ``forget`` or ``take``)."""
        return None if self._state is None else self._state.step

    def take(self) -> TrainState:
        """The kept state, handed over: its buffers are the caller's now (the next ``keep`` makes new ones)."""
        state = self._state
        if state is None:
            raise RuntimeError("no state kept: keep(state) before the step")
        if self._kept is not None:
            leaves, spec, where = self._kept
            state = tree_unflatten(
                [
                    leaf
                    if index is None
                    else self._buffers[index]
                    .view(leaf.dtype)
                    .as_strided(leaf.shape, leaf.stride(), leaf.storage_offset())
                    for leaf, index in zip(leaves, where)
                ],
                spec,
            )
        self.forget()
        return state

    def forget(self) -> None:
        """Drop what is kept (the world changed, or the state went back)."""
        self._state, self._buffers, self._kept, self._sources = None, [], None, {}

    def __repr__(self) -> str:
        return f"KeptState(copies={self.copies}, step={self.step})"
