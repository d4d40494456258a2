"""Between a whole state and this rank's sharded one: what a checkpoint holds and what a rank steps.

A sharded optimizer state is that of the optimizer run on ``{"bucket<i>": slice}``: plain
flat tensors, one per bucket, so ``sgd``, ``adam``, ``adamw`` and
``chain(clip_by_global_norm(...), ...)`` work on it unchanged. Stages 1 and 2 keep the
params whole, laid out as one padded flat buffer per bucket that the parameter tensors
are views of (the all-gather fills them in place); stage 3 keeps only this rank's slices
of the params too, keyed like the optimizer state.

Checkpoints hold the whole state (``gather_state``), so any world size and stage can
resume them (``shard_state``).

>>> from fdp import adam
>>> from fdp.comm import Comm
>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([("w", (3, 2), "float32", "cpu")])
>>> state = init_state({"w": torch.ones(3, 2)}, {}, adam(0.1), plan, Comm())
>>> list(state.opt_state.mu), state.opt_state.mu["bucket0"].shape
(['bucket0'], torch.Size([6]))
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fdp._torch import tree_map
from fdp.comm import Comm
from fdp.hooks import Hook, allreduce, init_hook_states
from fdp.model.functional import Buffers, Params
from fdp.optim import GradientTransformation
from fdp.plan import BucketPlan
from fdp.plan.buckets import slot_views
from fdp.state.train_state import TrainState
from fdp.update.base import STAGES
from fdp.update.zero.layout import check_names, flats_of, padded_flat, param_views, slice_key, slice_keys, slice_range

__all__ = [
    "init_state",
    "shard_state",
    "gather_state",
    "whole_params",
    "unsharded_template",
    "is_sharded",
    "params_sharded",
    "mirrors",
    "gather_outer",
    "shard_outer",
    "outer_template",
]


def _map_named(tree: Any, names: frozenset, fn: Callable[[dict], Any]) -> Any:
    """``tree`` with every dict keyed exactly by ``names`` replaced by ``fn(dict)``."""
    if isinstance(tree, dict) and tree and frozenset(tree) == names:
        return fn(tree)
    if isinstance(tree, dict):
        return {key: _map_named(value, names, fn) for key, value in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map_named(member, names, fn) for member in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_named(member, names, fn) for member in tree)
    return tree


def is_sharded(opt_state: Any, plan: BucketPlan) -> bool:
    """Whether ``opt_state`` holds slices keyed by bucket (``shard_state``) rather than whole params.

    A state that holds nothing per param (SGD without momentum) is both: nothing in it is whole.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (5,), "float32", "cpu")])
    >>> is_sharded({"m": {"w": torch.zeros(5)}}, plan), is_sharded({"m": {"bucket0": torch.zeros(3)}}, plan)
    (False, True)
    >>> is_sharded((), plan)
    True
    """
    sliced, whole = [], []
    _map_named(opt_state, frozenset(slice_keys(plan)), sliced.append)
    _map_named(opt_state, frozenset(plan.names), whole.append)
    return bool(sliced) or not whole


def params_sharded(params: Params, plan: BucketPlan) -> bool:
    """Whether ``params`` are this rank's slices by bucket (ZeRO stage 3) rather than whole tensors.

    >>> from fdp.plan import pack_into_buckets
    >>> params_sharded({"bucket0": torch.zeros(3)}, pack_into_buckets([("w", (5,), "float32", "cpu")]))
    True
    """
    return bool(params) and list(params) == slice_keys(plan)


def _slices(named: dict, plan: BucketPlan, rank: int, world: int) -> dict:
    """This rank's slice of every bucket of the whole tensors ``named`` (of the buckets they fill), each with storage
    of its own."""
    return {
        slice_key(b.index): padded_flat(b, world, named)[slice(*slice_range(b, rank, world))].clone()
        for b in plan.buckets
        if b.names[0] in named
    }


def _map_dicts(tree: Any, match: Callable[[dict], bool], fn: Callable[[dict], Any]) -> Any:
    """``tree`` with every non-empty dict that ``match``es replaced by ``fn(dict)``."""
    if isinstance(tree, dict) and tree and match(tree):
        return fn(tree)
    if isinstance(tree, dict):
        return {key: _map_dicts(value, match, fn) for key, value in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map_dicts(member, match, fn) for member in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_dicts(member, match, fn) for member in tree)
    return tree


def _by_buckets(plan: BucketPlan) -> Callable[[dict], bool]:
    """Whether a dict is keyed by slices of some of ``plan``'s buckets (an outer loop's anchor, moments, fragments)."""
    keys = frozenset(slice_keys(plan))
    return lambda tree: set(tree) <= keys


def _by_names(plan: BucketPlan) -> Callable[[dict], bool]:
    """Whether a dict is keyed by the params of whole buckets of ``plan``."""
    names = frozenset(plan.names)
    return lambda tree: set(tree) <= names


def _names_of(sharded: dict, plan: BucketPlan, order: list[str] | None) -> list[str]:
    """The params of the buckets whose slices ``sharded`` holds, in ``order`` (by default the plan's)."""
    names = {name for b in plan.buckets if slice_key(b.index) in sharded for name in b.names}
    return [name for name in order or plan.names if name in names]


def gather_outer(outer: Any, plan: BucketPlan, comm: Comm, order: list[str] | None = None) -> Any:
    """An outer loop's state over hybrid-sharded replicas (``fdp.update.zero.replicas``: anchor, outer moments and a
    sync in flight, held by slice) whole, keyed by param as a replica of whole params keeps it; every rank of the group
    ``comm`` receives it (a collective). ``order``: the params' order in the model, in which a replica of whole
    params (stage 0) keeps them, so that its checkpoint's outer state and this one read alike.

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (3,), "float32", "cpu")])
    >>> whole = gather_outer(({"bucket0": torch.arange(3.0)}, 2), plan, Comm())
    >>> whole, shard_outer(whole, plan, Comm())[0]["bucket0"].tolist()
    (({'w': tensor([0., 1., 2.])}, 2), [0.0, 1.0, 2.0])
    """
    return _map_dicts(
        outer, _by_buckets(plan), lambda sharded: _whole(sharded, plan, comm, _names_of(sharded, plan, order))
    )


def shard_outer(outer: Any, plan: BucketPlan, comm: Comm) -> Any:
    """``gather_outer``'s whole outer state as this rank's slices of it in the group ``comm``."""
    return _map_dicts(outer, _by_names(plan), lambda named: _slices(named, plan, comm.rank, comm.world_size))


def outer_template(outer: Any, plan: BucketPlan, order: list[str] | None = None) -> Any:
    """A state of ``gather_outer``'s structure for ``outer`` (held by slice), to restore a checkpoint into: empty
    placeholders keyed by param (in ``order``), on the slices' device."""

    def placeholders(sharded: dict) -> dict:
        first = next(iter(sharded.values()))
        return {name: first.new_empty(0) for name in _names_of(sharded, plan, order)}

    return _map_dicts(outer, _by_buckets(plan), placeholders)


def _mirrored(comm: Comm) -> int:
    """The rank whose slices this rank mirrors (``TrainState.mirror``): the next one."""
    return (comm.rank + 1) % comm.world_size


def init_state(
    params: Params,
    buffers: Buffers,
    optimizer: GradientTransformation,
    plan: BucketPlan,
    comm: Comm,
    hook: Hook | None = None,
    seed: int = 0,
    stage: int = 1,
    mirror: bool = False,
    precision: Any = None,
) -> TrainState:
    """The sharded state before step 1: params whole and laid out flat (stages 1, 2) or this
    rank's slices alone (stage 3), optimizer state for this rank's slices.

    ``params`` must already be the same on every rank. The unsharded optimizer state is
    never built, so it never takes memory. ``mirror`` (stage 1, more than one rank): the
    state also holds the optimizer state of the next rank's slices (``TrainState.mirror``).
    ``precision`` (an ``fdp.model.precision.Precision``): under ``16-mixed`` the state's loss scale, one
    scalar replicated on every rank, as at stage 0.
    """
    check_names(params, plan)
    rank, world = comm.rank, comm.world_size
    if stage == 3:
        sharded = _slices(params, plan, rank, world)
        owned = sharded
    else:
        flats = flats_of(params, plan, world, copy=True)
        sharded = param_views(plan, flats, list(params))
        owned = {slice_key(b.index): flat[slice(*slice_range(b, rank, world))] for b, flat in zip(plan.buckets, flats)}
    hook_state = init_hook_states(hook or allreduce(), plan)
    rng = torch.Generator().manual_seed(seed).get_state()
    mirrored = optimizer.init(_slices(params, plan, _mirrored(comm), world)) if mirrors(mirror, stage, world) else ()
    loss_scale = precision.init_loss_scale(plan.buckets[0].device) if precision is not None else None
    return TrainState(
        0, sharded, buffers, optimizer.init(owned), hook_state, rng, loss_scale=loss_scale, mirror=mirrored
    )


def mirrors(mirror: bool, stage: int, world: int) -> bool:
    """Whether a state of ``stage`` on ``world`` ranks keeps the next rank's optimizer slices; ``mirror=True`` at a
    stage that cannot is refused (``ValueError``).

    >>> mirrors(True, 1, 2), mirrors(True, 1, 1), mirrors(False, 3, 2)
    (True, False, False)
    """
    reason = STAGES[stage].refuses_mirror() if mirror else None
    if reason:
        keeping = " or ".join(str(s.number) for s in STAGES if s.shards_optimizer and s.refuses_mirror() is None)
        raise ValueError(f"mirror=True: expected zero_stage={keeping} ({reason})")
    return mirror and world > 1


def shard_state(state: TrainState, plan: BucketPlan, comm: Comm, stage: int = 1, mirror: bool = False) -> TrainState:
    """``state`` (whole, e.g. from a checkpoint) as this rank's sharded state for ``stage``.

    The optimizer state's per-parameter dicts become dicts of this rank's flat slices
    (``mirror``: and the next rank's, as ``TrainState.mirror``).
    """
    check_names(state.params, plan)
    rank, world = comm.rank, comm.world_size
    names = frozenset(plan.names)
    opt_state = _map_named(state.opt_state, names, lambda named: _slices(named, plan, rank, world))
    if mirrors(mirror, stage, world):
        mirrored = _map_named(state.opt_state, names, lambda named: _slices(named, plan, _mirrored(comm), world))
        state = state._replace(mirror=mirrored)
    if stage == 3:
        params = _slices(state.params, plan, rank, world)
    else:
        params = param_views(plan, flats_of(state.params, plan, world, copy=True), list(state.params))
    return state._replace(params=params, opt_state=opt_state)


def _whole(
    sharded: dict, plan: BucketPlan, comm: Comm, order: list[str], copy: bool = True, to: int | None = None
) -> dict | None:
    """Every rank's slices gathered into whole per-parameter tensors, keyed in ``order`` (a collective).

    ``copy=False`` leaves them views of each bucket's gathered buffer (half the memory; a
    checkpoint needs copies, or each tensor would save its whole bucket). With ``to``,
    only rank ``to`` receives them, each on the CPU as soon as its bucket arrives (what a
    checkpoint needs: a GPU never holds more than one whole bucket); the others get ``None``.
    """
    named: dict[str, torch.Tensor] = {}
    for bucket in plan.buckets:
        piece = sharded.get(slice_key(bucket.index))
        if piece is None:  # a part of the buckets (an outer loop's fragment): the others are not asked for
            continue
        if to is None:
            full = comm.allgather(piece).wait().reshape(-1)
        else:
            full = comm.gather(piece, to).wait()
            if full is None:
                continue
            full = full.reshape(-1)
        views = slot_views(bucket, full[: bucket.numel])
        if to is not None:
            views = {n: v.to("cpu", copy=True) for n, v in views.items()}
        named.update({n: v.clone() for n, v in views.items()} if copy and to is None else views)
    return {name: named[name] for name in order} if named or not order else None


def gather_state(state: TrainState, plan: BucketPlan, comm: Comm, to: int | None = None) -> TrainState:
    """The whole equivalent of sharded ``state``: what stage 0 would hold (a collective).

    Each slice of the optimizer state (and at stage 3 of the params) is gathered into
    whole per-parameter tensors, so the result saves and restores like a stage-0 state
    whatever the world size. Every rank receives them, or with ``to`` only that rank (on
    the CPU; a checkpoint's writer), the others keeping ``state`` as it is.
    """
    keys = frozenset(slice_keys(plan))
    # Stages 1 and 2 keep the model's order of the params (a stage-0 state's); stage 3 the plan's.
    order = list(plan.names) if params_sharded(state.params, plan) else list(state.params)
    opt_state = _map_named(state.opt_state, keys, lambda sharded: _whole(sharded, plan, comm, order, to=to))
    params = (
        _whole(state.params, plan, comm, order, to=to) if params_sharded(state.params, plan) else dict(state.params)
    )
    if to is not None and comm.rank != to:
        return state
    return state._replace(params=params, opt_state=opt_state)


def whole_params(state: TrainState, plan: BucketPlan, comm: Comm) -> Params:
    """``state``'s params, whole: at stage 3 all-gathered from every rank's slices (a collective).

    >>> from fdp import sgd
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (3,), "float32", "cpu")])
    >>> state = init_state({"w": torch.arange(3.0)}, {}, sgd(0.1), plan, Comm(), stage=3)
    >>> list(state.params), whole_params(state, plan, Comm())["w"].tolist()
    (['bucket0'], [0.0, 1.0, 2.0])
    """
    if not params_sharded(state.params, plan):
        return state.params
    return _whole(state.params, plan, comm, list(plan.names), copy=False)


def unsharded_template(state: TrainState, optimizer: GradientTransformation, plan: BucketPlan) -> TrainState:
    """``state`` with params and optimizer state of stage 0's structure: a template to restore into.

    Its tensors are empty placeholders on the params' device (restoring takes only the
    structure and the device from a template), so the whole state is never allocated.
    """
    device = next(iter(state.params.values())).device
    if params_sharded(state.params, plan):
        shapes = {slot.name: (slot.shape, bucket.torch_dtype) for bucket in plan.buckets for slot in bucket.slots}
        meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
    else:
        meta = {name: torch.empty_like(p, device="meta") for name, p in state.params.items()}

    def placeholder(t):
        return torch.empty(0, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) and t.is_meta else t

    params = {name: placeholder(t) for name, t in meta.items()}
    return state._replace(params=params, opt_state=tree_map(placeholder, optimizer.init(meta)))
