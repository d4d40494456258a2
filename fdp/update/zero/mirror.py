"""A ZeRO stage-1 state split again over the ranks a lost rank left (``fdp.procs.shrink``).

Each rank holds the optimizer state of its own slices and, in ``TrainState.mirror``,
that of the next rank's (``fdp.update.zero.sharded`` steps both). When ranks are lost, every
slice is still held by a survivor (its owner, or the rank before it) as long as no
two neighbouring ranks were lost together: each old slice is broadcast from one
survivor that holds it, the whole flat state of each bucket is put together, and every
survivor takes its new slice, and the next one's as its new mirror. The params are
whole on every rank already; they are laid out again for the new slice boundaries.

A world that grows back (``fdp.procs.grow``) splits its state the same way: every old slice
is held by its owner, the joiner holds none and receives its slice and mirror.
"""

from __future__ import annotations

from typing import Any

from fdp.comm import Comm
from fdp.plan import BucketPlan
from fdp.state.train_state import TrainState
from fdp.update.zero.convert import _map_named
from fdp.update.zero.layout import flats_of, param_views, slice_key, slice_keys, slice_numel

__all__ = ["LostSlices", "holders", "reshard_survivors"]


class LostSlices(RuntimeError):
    """A slice of the optimizer state was held only by ranks that were all lost."""


def holders(old_members: tuple[int, ...], new_members: tuple[int, ...]) -> dict[int, tuple[int, str]]:
    """Who holds each old slice after the loss: ``{old index: (new rank, "own" | "mirror")}``.

    >>> holders((0, 1, 2), (0, 1))  # slice 2 was rank 2's; rank 1 mirrors it
    {0: (0, 'own'), 1: (1, 'own'), 2: (1, 'mirror')}
    >>> holders((0, 1, 2), (0,))  # doctest: +NORMALIZE_WHITESPACE
    ... # rank 0 mirrors slice 1; slice 2 was on ranks 2 and 1 alone
    Traceback (most recent call last):
    ...
    fdp.update.zero.mirror.LostSlices: the optimizer-state slices of rank 2 were held only by lost ranks
    (neighbours lost together)
    """
    world, out, missing = len(old_members), {}, []
    for index, member in enumerate(old_members):
        before = old_members[(index - 1) % world]
        if member in new_members:
            out[index] = (new_members.index(member), "own")
        elif before in new_members and world > 1:
            out[index] = (new_members.index(before), "mirror")
        else:
            missing.append(member)
    if missing:
        raise LostSlices(
            f"the optimizer-state slices of rank {', '.join(map(str, missing))} were held only by "
            "lost ranks (neighbours lost together)"
        )
    return out


def _named_dicts(tree: Any, names: frozenset) -> list[dict]:
    found: list[dict] = []
    _map_named(tree, names, lambda d: found.append(d) or d)
    return found


def _replaced(tree: Any, names: frozenset, values: list[dict]) -> Any:
    remaining = iter(values)
    return _map_named(tree, names, lambda d: next(remaining))


def _resplit(own: dict, mirror: dict, plan: BucketPlan, held: dict, comm: Comm, old_world: int) -> tuple[dict, dict]:
    """This rank's new slices and new mirror of one per-bucket dict of the optimizer state (a collective)."""
    new_own, new_mirror = {}, {}
    world, rank = comm.world_size, comm.rank
    for bucket in plan.buckets:
        key = slice_key(bucket.index)
        size = slice_numel(bucket, old_world)
        whole = own[key].new_zeros(size * old_world)
        for index, (source, kind) in sorted(held.items()):
            piece = whole[index * size : (index + 1) * size]
            if source == rank:
                piece.copy_(own[key] if kind == "own" else mirror[key])
            comm.broadcast(piece, source).wait()
        new_size = slice_numel(bucket, world)
        flat = whole.new_zeros(new_size * world)
        flat[: bucket.numel] = whole[: bucket.numel]
        new_own[key] = flat[rank * new_size : (rank + 1) * new_size].clone()
        following = (rank + 1) % world
        new_mirror[key] = flat[following * new_size : (following + 1) * new_size].clone()
    return new_own, new_mirror


def reshard_survivors(
    state: TrainState, plan: BucketPlan, old_members: tuple[int, ...], new_members: tuple[int, ...], comm: Comm
) -> TrainState:
    """``state``, sharded over ``old_members`` with a mirror, as this rank's state over ``new_members`` (a collective
    of the new world, whose ranks are ``new_members`` in order). ``LostSlices`` when a slice is gone."""
    held = holders(old_members, new_members)
    names = frozenset(slice_keys(plan))
    owns, mirrors = _named_dicts(state.opt_state, names), _named_dicts(state.mirror, names)
    pairs = [_resplit(own, mirror, plan, held, comm, len(old_members)) for own, mirror in zip(owns, mirrors)]
    opt_state = _replaced(state.opt_state, names, [own for own, _ in pairs])
    mirror = _replaced(state.mirror, names, [m for _, m in pairs]) if comm.world_size > 1 else ()
    params = param_views(plan, flats_of(state.params, plan, comm.world_size, copy=True), list(state.params))
    return state._replace(params=params, opt_state=opt_state, mirror=mirror)
