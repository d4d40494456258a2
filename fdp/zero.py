"""Sharded data parallel on the bucket plan: ZeRO stages 1 and 2.

Every rank owns an equal slice of each bucket's flat layout: with ``N`` ranks a bucket of
``n`` elements is padded to ``N * ceil(n / N)`` and rank ``r`` owns elements
``[r * L, (r + 1) * L)``, ``L = ceil(n / N)``, balanced to the element, so a slice
boundary may fall inside a parameter.

* Stage 1: gradients are reduced as at stage 0 (the hook chain all-reduces each
  bucket); each rank steps only its slice of the params, with optimizer state for that
  slice alone, and all-gathers the updated slice into every rank's full params.
* Stage 2: the reduction reduce-scatters each bucket instead, so a rank receives only
  its slice of the averaged gradient, and the bucket buffers are released between steps.

The params stay whole on every rank (stage 1 and 2 do not shard them), laid out as one
padded flat buffer per bucket that the parameter tensors are views of, so a slice update
writes straight into them and the all-gather fills them in place. The optimizer state is
that of the optimizer run on ``{"bucket<i>": slice}``: plain flat tensors, so ``sgd``,
``adam``, ``adamw`` and ``chain(clip_by_global_norm(...), ...)`` work unchanged (the
clipping norm is summed across the slices, see ``fdp.optim.across_shards``).

A bucket's update and all-gather start as soon as its reduction has finished, while later
buckets are still on the wire; the all-gathers are awaited at the end of the step.

Checkpoints hold the unsharded state (``gather_state``), so any world size and any stage
can resume them (``shard_state``).

>>> from fdp import adam
>>> from fdp.plan import pack_into_buckets
>>> plan = pack_into_buckets([("w", (3, 2), "float32", "cpu")])
>>> shard_range(plan.buckets[0], rank=1, world=4)  # 6 elements over 4 ranks: 2 each, the last one padding
(2, 4)
>>> state = init_state({"w": torch.ones(3, 2)}, {}, adam(0.1), plan, Comm())
>>> list(state.opt_state.mu), state.opt_state.mu["bucket0"].shape
(['bucket0'], torch.Size([6]))
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any, Callable

import torch

from fdp._torch import storage_alias, tree_map
from fdp.buckets import slot_views
from fdp.comm import Comm, Pending
from fdp.functional import Buffers, Params
from fdp.hooks import Hook, allreduce
from fdp.optim import GradientTransformation, across_shards, apply_gradients
from fdp.plan import Bucket, BucketPlan
from fdp.reduce import init_hook_states
from fdp.trace import NullTimeline, Timeline

__all__ = [
    "ZERO_STAGES", "check_zero_stage", "check_hooks_for_stage", "shard_range", "shard_key", "init_state",
    "shard_state", "gather_state", "unsharded_template", "is_sharded", "state_nbytes", "ShardedUpdate",
]

ZERO_STAGES = (0, 1, 2)
# Hooks that need the whole reduced bucket (or all-reduce tensors other than the bucket).
_WHOLE_BUCKET_HOOKS = ("powersgd", "batched_powersgd", "topk")


def check_zero_stage(stage: int) -> int:
    """``zero_stage``: 0 (every rank holds everything), 1 (shard optimizer state) or 2 (and gradients).

    >>> check_zero_stage(3)
    Traceback (most recent call last):
    ValueError: zero_stage=3: expected 0, 1 or 2
    """
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={stage!r}: expected 0, 1 or 2")
    return stage


def check_hooks_for_stage(stage: int, spec: Any) -> None:
    """Refuse a hook spec whose chain needs the whole reduced bucket under stage 2.

    >>> check_hooks_for_stage(2, {"name": "powersgd", "rank": 2})
    Traceback (most recent call last):
    ValueError: zero_stage=2: hooks 'powersgd' need the whole reduced bucket, which stage 2 scatters; expected hooks allreduce, fp16, bf16 or noop (or zero_stage=1)
    """
    if stage < 2:
        return
    refused = [name for name in _hook_names(spec) if name in _WHOLE_BUCKET_HOOKS]
    if refused:
        raise ValueError(
            f"zero_stage=2: hooks {refused[0]!r} need the whole reduced bucket, which stage 2 scatters; "
            "expected hooks allreduce, fp16, bf16 or noop (or zero_stage=1)"
        )


def _hook_names(spec: Any) -> list[str]:
    if isinstance(spec, str):
        return [spec]
    if isinstance(spec, Mapping):
        names = [spec["name"]] if isinstance(spec.get("name"), str) else []
        for key in ("chain", "stages"):
            for stage in spec.get(key) or ():
                names += _hook_names(stage)
        return names
    return []


# -- the layout ---------------------------------------------------------------------------
def _shard_numel(bucket: Bucket, world: int) -> int:
    return math.ceil(bucket.numel / world)


def shard_range(bucket: Bucket, rank: int, world: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s slice in the bucket's padded flat layout.

    >>> from fdp.plan import pack_into_buckets
    >>> [shard_range(pack_into_buckets([("w", (5,), "float32", "cpu")]).buckets[0], r, 2) for r in (0, 1)]
    [(0, 3), (3, 6)]
    """
    size = _shard_numel(bucket, world)
    return rank * size, (rank + 1) * size


def shard_key(index: int) -> str:
    """The optimizer-state key of bucket ``index``'s slice.

    >>> shard_key(3)
    'bucket3'
    """
    return f"bucket{index}"


def _padded_flat(bucket: Bucket, world: int, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors of ``values`` as one zero-padded flat tensor (a copy)."""
    flat = torch.zeros(_shard_numel(bucket, world) * world, dtype=bucket.torch_dtype, device=bucket.device)
    views = slot_views(bucket, flat[: bucket.numel])
    with torch.no_grad():
        for name, view in views.items():
            view.copy_(values[name])
    return flat


def _param_views(plan: BucketPlan, flats: list[torch.Tensor], order: list[str]) -> Params:
    views: dict[str, torch.Tensor] = {}
    for bucket, flat in zip(plan.buckets, flats):
        views.update(slot_views(bucket, flat[: bucket.numel]))
    return {name: views[name] for name in order}


def _laid_out_flat(params: Params, bucket: Bucket, padded: int) -> torch.Tensor | None:
    """The padded flat buffer ``params`` of ``bucket`` are views of, if they are laid out that way."""
    first, slot0 = params[bucket.slots[0].name], bucket.slots[0]
    base = first.storage_offset() - slot0.offset
    storage = first.untyped_storage()
    if base < 0 or storage.nbytes() < (base + padded) * first.element_size() or first.dtype != bucket.torch_dtype:
        return None
    for slot in bucket.slots:
        p = params[slot.name]
        if (p.untyped_storage().data_ptr() != storage.data_ptr() or p.storage_offset() != base + slot.offset
                or not p.is_contiguous() or p.dtype != first.dtype):
            return None
    return storage_alias(first, -slot0.offset, (padded,), (1,))


def _flats_of(params: Params, plan: BucketPlan, world: int, copy: bool) -> list[torch.Tensor]:
    flats = []
    for bucket in plan.buckets:
        padded = _shard_numel(bucket, world) * world
        flat = None if copy else _laid_out_flat(params, bucket, padded)
        flats.append(flat if flat is not None else _padded_flat(bucket, world, params))
    return flats


# -- the state ----------------------------------------------------------------------------
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


def _shard_keys(plan: BucketPlan) -> frozenset:
    return frozenset(shard_key(b.index) for b in plan.buckets)


def is_sharded(opt_state: Any, plan: BucketPlan) -> bool:
    """Whether ``opt_state`` holds slices keyed by bucket (``shard_state``) rather than whole params."""
    keys, found = _shard_keys(plan), []
    _map_named(opt_state, keys, lambda d: found.append(d))
    return bool(found)


def _slice_dict(named: dict, plan: BucketPlan, rank: int, world: int) -> dict:
    out = {}
    for bucket in plan.buckets:
        start, stop = shard_range(bucket, rank, world)
        out[shard_key(bucket.index)] = _padded_flat(bucket, world, named)[start:stop].clone()
    return out


def init_state(
    params: Params, buffers: Buffers, optimizer: GradientTransformation, plan: BucketPlan, comm: Comm,
    hook: Hook | None = None, seed: int = 0,
):
    """The sharded state before step 1: full params laid out flat, optimizer state for this rank's slices.

    The unsharded optimizer state is never built, so it never takes memory.
    """
    from fdp.train import TrainState  # fdp.train builds its sharded steps from this module

    _check_names(params, plan)
    rank, world = comm.rank, comm.world_size
    flats = _flats_of(params, plan, world, copy=True)
    slices = {shard_key(b.index): flat[slice(*shard_range(b, rank, world))] for b, flat in zip(plan.buckets, flats)}
    hook_state = init_hook_states(hook or allreduce(), plan)
    rng = torch.Generator().manual_seed(seed).get_state()
    return TrainState(0, _param_views(plan, flats, list(params)), buffers, optimizer.init(slices), hook_state, rng)


def shard_state(state, plan: BucketPlan, comm: Comm):
    """``state`` (unsharded, e.g. from a checkpoint) as this rank's sharded state.

    The optimizer state's per-parameter dicts become dicts of this rank's flat slices.
    """
    _check_names(state.params, plan)
    rank, world = comm.rank, comm.world_size
    flats = _flats_of(state.params, plan, world, copy=True)
    names = frozenset(plan.names)
    opt_state = _map_named(state.opt_state, names, lambda named: _slice_dict(named, plan, rank, world))
    return state._replace(params=_param_views(plan, flats, list(state.params)), opt_state=opt_state)


def gather_state(state, plan: BucketPlan, comm: Comm):
    """The unsharded equivalent of sharded ``state``: what stage 0 would hold (a collective).

    Every rank all-gathers each slice of the optimizer state into whole per-parameter
    tensors, keyed in the params' order, so the result saves and restores like a stage-0
    state whatever the world size.
    """
    order = list(state.params)

    def whole(sharded: dict) -> dict:
        named: dict[str, torch.Tensor] = {}
        for bucket in plan.buckets:
            piece = sharded[shard_key(bucket.index)]
            full = comm.allgather(piece).wait().reshape(-1)
            named.update({n: v.clone() for n, v in slot_views(bucket, full[: bucket.numel]).items()})
        return {name: named[name] for name in order}

    opt_state = _map_named(state.opt_state, _shard_keys(plan), whole)
    return state._replace(params=dict(state.params), opt_state=opt_state)


def unsharded_template(state, optimizer: GradientTransformation):
    """``state`` with an optimizer state of stage 0's structure: a template to restore into.

    Its tensors are empty placeholders on the params' device (restoring takes only the
    structure and the device from a template), so the whole state is never allocated.
    """
    meta = {name: torch.empty_like(p, device="meta") for name, p in state.params.items()}
    device = next(iter(state.params.values())).device
    placeholder = lambda t: torch.empty(0, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) and t.is_meta else t
    return state._replace(opt_state=tree_map(placeholder, optimizer.init(meta)))


def _check_names(params: Params, plan: BucketPlan) -> None:
    if set(params) != set(plan.names):
        raise ValueError(f"zero: params and bucket plan name different tensors: {sorted(set(params) ^ set(plan.names))[:5]}")


def state_nbytes(state, grad_buffers: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of params, optimizer state and gradient buffers held, each storage counted once.

    >>> from fdp import sgd
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (4,), "float32", "cpu")])
    >>> state_nbytes(init_state({"w": torch.ones(4)}, {}, sgd(0.1, momentum=0.9), plan, Comm()))  # params, momentum
    32
    """
    from fdp._torch import tree_flatten

    seen: dict[int, int] = {}
    tensors = [*state.params.values(), *tree_flatten(state.opt_state)[0], *grad_buffers]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


# -- stage 2: the reduction reduce-scatters ------------------------------------------------
class _ScatterComm:
    """A ``Comm`` for the hook chain under stage 2: its all-reduce of a bucket is a reduce-scatter.

    ``allreduce(bucket)`` gives back this rank's slice of the sum (``ceil(n / N)``
    elements), so ``allreduce()`` and the fp16/bf16 casts around it hand back the averaged
    slice. Anything else a chain asks for (all-reducing smaller tensors, all-gathers) needs
    the whole bucket and is refused.
    """

    def __init__(self, comm: Comm, plan: BucketPlan):
        self.inner, self.group = comm, comm.group
        self._numels = {b.numel for b in plan.buckets}

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def rank(self) -> int:
        return self.inner.rank

    def allreduce(self, tensor: torch.Tensor) -> Pending:
        if tensor.dim() != 1 or tensor.numel() not in self._numels:
            raise ValueError(_REFUSED)
        world = self.world_size
        size = math.ceil(tensor.numel() / world)
        if size * world != tensor.numel():
            padded = tensor.new_zeros(size * world)
            padded[: tensor.numel()] = tensor
            tensor = padded
        return self.inner.reduce_scatter(tensor)

    def allgather(self, tensor: torch.Tensor) -> Pending:
        raise ValueError(_REFUSED)

    def take_counters(self) -> tuple[int, int]:
        return self.inner.take_counters()


_REFUSED = ("zero_stage=2: the hook chain needs the whole reduced bucket (PowerSGD, top-k), "
            "which stage 2 scatters; expected hooks allreduce, fp16, bf16 or noop (or zero_stage=1)")


# -- the sharded update of one step ---------------------------------------------------------
class ShardedUpdate:
    """The optimizer step of ``make_train_step`` under ZeRO stage 1 or 2.

    ``reduction_comm()`` is the ``Comm`` the reducer must use; each step then calls
    ``begin(state, in_place)``, hands every reduced bucket to the returned step's
    ``reduced``, and ends with its ``finish``.
    """

    def __init__(self, optimizer: GradientTransformation, plan: BucketPlan, comm: Comm, stage: int,
                 timeline: Timeline | None = None):
        self.optimizer, self.plan, self.stage = optimizer, plan, check_zero_stage(stage)
        if stage == 0:
            raise ValueError("zero_stage=0 has no sharded update")
        self.comm = comm
        self.timeline = timeline or NullTimeline()
        self._scatter = _ScatterComm(comm, plan) if stage == 2 else None
        self._grad_buffers: tuple[torch.Tensor, ...] = ()
        self._released: list[int] = []

    def reduction_comm(self) -> Any:
        return self._scatter or self.comm

    def hold_grad_buffers(self, buffers: tuple[torch.Tensor, ...]) -> None:
        """The reducer's bucket buffers: stage 2 frees each once its slice is out, and regrows them each step."""
        self._grad_buffers = buffers

    def grad_buffers(self) -> tuple[torch.Tensor, ...]:
        return self._grad_buffers

    def begin(self, state, in_place: bool) -> "_ShardedStep":
        if not is_sharded(state.opt_state, self.plan):
            raise ValueError("zero: the optimizer state is not sharded; build the state with fdp.zero.init_state or shard_state")
        for index in self._released:  # backward writes every element before it is read
            buffer = self._grad_buffers[index]
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        self._released = []
        return _ShardedStep(self, state, in_place)

    def release(self, index: int) -> None:
        # Unused buckets are never written by backward and must stay zero: they are kept.
        if self.stage == 2 and self._grad_buffers and not self.plan.buckets[index].unused:
            self._grad_buffers[index].untyped_storage().resize_(0)
            self._released.append(index)


class _ShardedStep:
    def __init__(self, owner: ShardedUpdate, state, in_place: bool):
        self.owner, self.state, self.in_place = owner, state, in_place
        comm, plan = owner.comm, owner.plan
        self.rank, self.world = comm.rank, comm.world_size
        # A step that may not touch ``state`` (donate=False) works on copies of the params.
        self.flats = _flats_of(state.params, plan, self.world, copy=not in_place)
        self.params = dict(state.params) if in_place else _param_views(plan, self.flats, list(state.params))
        self.ranges = [shard_range(b, self.rank, self.world) for b in plan.buckets]
        self.grads: dict[str, torch.Tensor] = {}
        self.gathers: list[Pending] = []
        self.opt_state = state.opt_state
        self.finite: list[tuple[int, torch.Tensor]] = []
        self.wait_s = 0.0  # blocked on this step's all-gathers and norm all-reduce

    def _param_slices(self, indices) -> dict[str, torch.Tensor]:
        return {shard_key(i): self.flats[i][slice(*self.ranges[i])] for i in indices}

    def reduced(self, index: int, buffer: torch.Tensor, per_bucket: bool) -> None:
        """Take bucket ``index``'s reduced gradient; with ``per_bucket``, step and gather its slice now."""
        owner = self.owner
        bucket = owner.plan.buckets[index]
        start, stop = self.ranges[index]
        if owner.stage == 2 and buffer.numel() == stop - start:
            # The slice may be a view of the bucket buffer (gloo), which is released below.
            grad = buffer.clone() if self._shares(buffer, index) else buffer
            self.finite.append((index, torch.isfinite(grad.sum(dtype=torch.float32))))
        elif buffer.numel() != bucket.numel:
            raise ValueError(_REFUSED)
        else:
            # The whole bucket (stage 1, or a chain that sends nothing): this rank's slice of it.
            self.finite.append((index, torch.isfinite(buffer.sum(dtype=torch.float32))))
            grad = buffer[start : min(stop, bucket.numel)]
            if grad.numel() != stop - start:  # this slice runs into the padding
                grad = torch.cat([grad, grad.new_zeros(stop - start - grad.numel())])
        owner.release(index)
        key = shard_key(index)
        if per_bucket:
            with owner.timeline.span("optimizer", bucket=index):
                self.opt_state = owner.optimizer.update_inplace({key: grad}, self.state.opt_state, self._param_slices([index]))
            self._gather(index)
        else:
            self.grads[key] = grad

    def _shares(self, tensor: torch.Tensor, index: int) -> bool:
        buffers = self.owner.grad_buffers()
        return bool(buffers) and tensor.untyped_storage().data_ptr() == buffers[index].untyped_storage().data_ptr()

    def _gather(self, index: int) -> None:
        start, stop = self.ranges[index]
        # The updated slice already sits in its place in the flat buffer: gathered in place.
        self.gathers.append(self.owner.comm.all_gather_into(self.flats[index], self.flats[index][start:stop]))

    def verdict(self) -> torch.Tensor:
        """True on the device when every gradient is finite, the same on every rank (no host sync)."""
        ok = torch.stack([flag for _, flag in self.finite]).all()
        if self.owner.stage == 2 and self.world > 1:  # each rank saw only its slices
            bad = self.owner.comm.allreduce((~ok).to(torch.float32).reshape(1)).wait()
            ok = bad[0] == 0
        return ok

    def finish(self) -> tuple[dict, Any]:
        """Step the slices not stepped yet, wait for every all-gather; ``(params, opt_state)``."""
        owner = self.owner
        if self.grads:
            indices = [b.index for b in owner.plan.buckets]
            slices = self._param_slices(indices)
            with owner.timeline.span("optimizer"), across_shards(self._sum_across):
                new_slices, self.opt_state = apply_gradients(
                    owner.optimizer, self.grads, self.state.opt_state, slices, donate=self.in_place
                )
            for index in indices:
                key = shard_key(index)
                if new_slices[key] is not slices[key]:
                    with torch.no_grad():
                        slices[key].copy_(new_slices[key])
                self._gather(index)
        t0 = time.perf_counter()
        for pending in self.gathers:
            pending.wait()
        self.wait_s += time.perf_counter() - t0
        return self.params, self.opt_state

    def _sum_across(self, tensor: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        total = self.owner.comm.allreduce(tensor.clone()).wait()
        self.wait_s += time.perf_counter() - t0
        return total

    def nonfinite_where(self) -> str:
        """Where this rank saw a non-finite gradient: one of its buckets, or another rank's slice."""
        where = [index for index, ok in self.finite if not bool(ok)]
        return f"bucket {where[0]}" if where else "a bucket of another rank's slice"
