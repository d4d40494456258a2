"""An asynchronous sharded save's staging copy, planned once: the loop waits for one copy per piece.

The loop goes on with its state while a thread writes a checkpoint of it
(``fdp.run.checkpoint.sharded``), so the pieces a rank writes are first copied to buffers of
their own; that copy is all the loop waits for. fdp's bucket plan is static, so the pieces
(``Update.checkpoint_pieces``) are the same ranges of the same leaves of the state at every
save: the first save of a state of a given layout finds, for each piece, the leaf it is a
view of and its range there, and gives it a CPU buffer of its own (pinned where the state is
on a GPU; a storage no larger than the piece, which DCP writes without copying it again),
kept from save to save and marked as DCP's chunk once. Every later save is one copy per
piece from the place found, with no other work per piece. A piece that is no view of a leaf
(a copy made by a conversion) leaves that layout unplanned: its pieces are then worked out
and copied at every save, into buffers that are kept too.

>>> state = {"params": {"w": torch.arange(6.0)}}
>>> def pieces(trees):  # this rank writes elements 2..5 of w, as a chunk of a logical tensor of 6
...     return {"params['w']": mark_chunk(trees[0]["params"]["w"][2:], (6,), (2,))}, [{}]
>>> staging = Staging()
>>> staged, _ = staging.stage([state], pieces, key=("a layout",))
>>> staged["params['w']"].tolist(), chunk_of(staged["params['w']"])
([2.0, 3.0, 4.0, 5.0], ((6,), (2,)))
>>> state["params"]["w"].add_(1)  # the loop goes on: the copy keeps what was saved
tensor([1., 2., 3., 4., 5., 6.])
>>> staged["params['w']"].tolist(), staging.stage([state], pieces, key=("a layout",))[0]["params['w']"].tolist()
([2.0, 3.0, 4.0, 5.0], [3.0, 4.0, 5.0, 6.0])
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fdp._torch import chunk_of, mark_chunk, tree_flatten, tree_paths

__all__ = ["Staging"]

# The pieces of the trees' logical tensors, and per tree its leaves that are not tensors (by their keys).
Pieces = Callable[[list], tuple[dict[str, torch.Tensor], list[dict[str, Any]]]]


class _Copy(NamedTuple):
    """Elements ``[lo, hi)`` of leaf ``leaf`` of ``trees[tree][prefix]`` into ``buffer`` (a piece's own)."""

    tree: int
    prefix: str
    leaf: int
    lo: int
    hi: int
    buffer: torch.Tensor


class _Plan(NamedTuple):
    layout: tuple  # what the plan was made for: the caller's key and every leaf's place, shape and dtype
    key: tuple  # the caller's key itself: its objects, compared by identity, live as long as the plan
    copies: list[_Copy]
    staged: dict[str, torch.Tensor]  # the copies' buffers, marked as the pieces were
    plain: list[list[tuple[str, int, str]]]  # per tree: (prefix, leaf, key) of each leaf that is not a tensor


def _flat(trees: list[dict]) -> list[dict[str, tuple[list, Any]]]:
    return [{prefix: tree_flatten(value) for prefix, value in tree.items()} for tree in trees]


def _leaf_layout(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device
    return type(leaf)


def _layout(key: tuple, flat: list[dict]) -> tuple:
    named = tuple(k if isinstance(k, (int, str)) else id(k) for k in key)  # an update or a plan by identity
    return named, tuple(
        tuple((prefix, spec, tuple(_leaf_layout(leaf) for leaf in leaves)) for prefix, (leaves, spec) in tree.items())
        for tree in flat
    )


class Staging:
    """The staging copies of one saver (see the module docstring); made once, ``stage`` at every save.

    A save stages only once the previous save's write is complete: the buffers are overwritten.
    """

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        self._loose: dict[str, torch.Tensor] = {}  # an unplanned layout's buffers, by piece

    def stage(self, trees: list[dict], pieces: Pieces, key: tuple) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """``(staged pieces, per tree its plain leaves)``: copies of ``pieces(trees)``, whose tensors are views of
        the leaves of ``trees`` (each a ``{prefix: subtree}`` as ``fdp.update.pieces.state_pieces`` takes), and what
        it says of the leaves that are not tensors. ``key`` names whatever else decides the pieces (the update,
        the plan, the rank and world): the plan made for one key and layout serves the saves that match both."""
        flat = _flat(trees)
        layout = _layout(key, flat)
        if self._plan is None or self._plan.layout != layout:
            tensors, plains = pieces(trees)
            self._plan = _planned(layout, key, trees, flat, tensors, plains)
            if self._plan is None:
                return self._copied(tensors), plains
            self._loose = {}
        for copy in self._plan.copies:
            leaf = flat[copy.tree][copy.prefix][0][copy.leaf]
            copy.buffer.view(-1).copy_(leaf.detach().view(-1)[copy.lo : copy.hi])
        plains = [{k: tree[prefix][0][leaf] for prefix, leaf, k in keys} for tree, keys in zip(flat, self._plan.plain)]
        return dict(self._plan.staged), plains

    def _copied(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The unplanned way: each piece copied into a buffer of its own, kept where it fits the next save's."""
        self._loose = {key: _staged(t, self._loose.get(key)) for key, t in tensors.items()}
        return dict(self._loose)


def _staged(tensor: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """A CPU copy of ``tensor`` that keeps its DCP chunk fields, in ``into`` where it fits."""
    fits = into is not None and into.shape == tensor.shape and into.dtype == tensor.dtype
    copy = into if fits else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    copy.copy_(tensor.detach())
    chunk = chunk_of(tensor)
    return mark_chunk(copy, *chunk) if chunk else copy


def _planned(layout: tuple, key: tuple, trees: list, flat: list, tensors: dict, plains: list) -> _Plan | None:
    """Where each piece lies in the leaves (``None`` where one lies in none), and a buffer for each."""
    by_storage: dict[int, list[tuple[int, str, int, torch.Tensor]]] = {}
    for t, tree in enumerate(flat):
        for prefix, (leaves, _) in tree.items():
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) and leaf.is_contiguous():
                    by_storage.setdefault(leaf.untyped_storage().data_ptr(), []).append((t, prefix, i, leaf))
    places: dict[str, tuple[tuple[int, str, int], int, torch.Tensor]] = {}
    for name, piece in tensors.items():
        place = _place(piece, by_storage)
        if place is None:
            return None
        places[name] = place
    copies, staged = [], {}
    for name, ((t, prefix, i), start, piece) in places.items():
        buffer = torch.empty(piece.shape, dtype=piece.dtype, pin_memory=piece.is_cuda)
        chunk = chunk_of(piece)
        staged[name] = mark_chunk(buffer, *chunk) if chunk else buffer
        copies.append(_Copy(t, prefix, i, start, start + piece.numel(), buffer))
    plain = [_plain_places(tree, wanted) for tree, wanted in zip(trees, plains)]
    if any(p is None for p in plain):
        return None
    return _Plan(layout, key, copies, staged, plain)


def _place(piece: torch.Tensor, by_storage: dict) -> tuple[tuple[int, str, int], int, torch.Tensor] | None:
    """``((tree, prefix, leaf), element offset, piece)``: the contiguous leaf ``piece`` is a contiguous range of."""
    if not piece.is_contiguous():
        return None
    for t, prefix, i, leaf in by_storage.get(piece.untyped_storage().data_ptr(), ()):
        start = piece.storage_offset() - leaf.storage_offset()
        if leaf.dtype == piece.dtype and 0 <= start and start + piece.numel() <= leaf.numel():
            return (t, prefix, i), start, piece
    return None


def _plain_places(tree: dict, wanted: dict[str, Any]) -> list[tuple[str, int, str]] | None:
    """``(prefix, leaf, key)`` of each of ``wanted``'s keys (``prefix`` + the leaf's path), or ``None`` where one of
    them is no leaf of ``tree``."""
    if not wanted:
        return []
    found = []
    for prefix, value in tree.items():
        leaves, _ = tree_flatten(value)
        for i, path in enumerate(tree_paths(value)):
            if prefix + path in wanted and not isinstance(leaves[i], torch.Tensor):
                found.append((prefix, i, prefix + path))
    return found if len(found) == len(wanted) else None
