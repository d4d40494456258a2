"""Training across slow links: ranks step on their own and sync every few steps.

Per-step data parallelism reduces every gradient; across nodes on ordinary Ethernet that
reduction sets the pace. The outer loop here trades it for a sync every ``sync_every``
steps (local SGD; DiLoCo, Douillard et al. 2023):

* between syncs each rank runs the ordinary train step on its own gradients, with no
  communication at all (its ``Comm`` is a world of one);
* at a sync, the pseudo-gradient ``anchor - params`` (``anchor``: the params every rank
  agreed on at the last sync) goes through the same bucket plan and hook chain as
  gradients do (so ``hooks=bf16`` or ``hooks=powersgd`` compress it, with their own
  state), and an outer optimizer steps the anchor with it; every rank restarts from the
  new anchor.

``local_sgd`` is the outer step ``anchor - mean(anchor - params)``, the mean of the
params (SGD with rate 1, no momentum); ``diloco`` is Nesterov SGD, by default with rate
0.7 and momentum 0.9. ``start_step=K`` keeps per-step gradient sync for the first K
steps (post-local SGD). The anchor, the outer optimizer state and the pseudo-gradient's
hook states live in ``TrainState.outer``; the schedule follows ``TrainState.step``, so a
run resumed from a checkpoint in the middle of a period goes on exactly as it would have.
Each rank's inner optimizer state stays its own, as in DiLoCo.
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch

from fdp._torch import foreach
from fdp.buckets import allocate, slot_views
from fdp.comm import Comm
from fdp.functional import Params
from fdp.hooks import Hook, allreduce
from fdp.optim import GradientTransformation, apply_gradients, sgd
from fdp.plan import BucketPlan
from fdp.reduce import Reduction, init_hook_states
from fdp.train import TrainState, make_train_step

OUTER = ("none", "local_sgd", "diloco")


class OuterSpec(NamedTuple):
    """The outer loop's settings (``conf/outer/*.yaml``); ``name="none"`` syncs every step."""

    name: str = "none"
    sync_every: int = 1
    start_step: int = 0
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False


class OuterState(NamedTuple):
    """What the outer loop carries from sync to sync (``TrainState.outer``).

    ``anchor``: the params at the last sync, the same on every rank; ``opt_state``: the
    outer optimizer's state; ``hook_state``: one state per bucket for the pseudo-gradient's
    hook chain; ``syncs``: syncs done so far.
    """

    anchor: Params
    opt_state: Any
    hook_state: tuple
    syncs: int


def check_outer(spec: dict | OuterSpec) -> OuterSpec:
    """The outer settings as an ``OuterSpec``; a ``ValueError`` naming the first bad one.

    >>> check_outer({"name": "diloco", "sync_every": 16, "lr": 0.7, "momentum": 0.9, "nesterov": True}).sync_every
    16
    >>> check_outer({"name": "local_sgd", "sync_every": 0})
    Traceback (most recent call last):
    ValueError: outer.sync_every=0: expected an integer >= 1
    """
    spec = OuterSpec(**spec) if isinstance(spec, dict) else spec
    if spec.name not in OUTER:
        raise ValueError(f"outer={spec.name!r}: expected none, local_sgd or diloco")
    if spec.name == "none":
        return spec
    if spec.sync_every < 1:
        raise ValueError(f"outer.sync_every={spec.sync_every!r}: expected an integer >= 1")
    if spec.start_step < 0:
        raise ValueError(f"outer.start_step={spec.start_step!r}: expected an integer >= 0")
    if spec.name == "local_sgd" and (spec.lr, spec.momentum, spec.nesterov) != (1.0, 0.0, False):
        raise ValueError("outer=local_sgd: averages the params (lr=1, momentum=0); expected outer=diloco for other outer lr or momentum")
    if not spec.lr > 0:
        raise ValueError(f"outer.lr={spec.lr!r}: expected a rate > 0")
    if not 0 <= spec.momentum < 1:
        raise ValueError(f"outer.momentum={spec.momentum!r}: expected a value in [0, 1)")
    if spec.nesterov and spec.momentum == 0:
        raise ValueError("outer.nesterov=true: expected outer.momentum > 0")
    return spec


def outer_optimizer(spec: OuterSpec) -> GradientTransformation:
    """The optimizer that steps the anchor with the averaged pseudo-gradient.

    >>> outer_optimizer(OuterSpec("diloco", 16, 0, 0.7, 0.9, True)).elementwise
    True
    """
    return sgd(spec.lr, momentum=spec.momentum, nesterov=spec.nesterov)


def init_outer_state(spec: OuterSpec, params: Params, plan: BucketPlan, hook: Hook | None = None) -> Any:
    """``TrainState.outer`` before step 1: ``()`` for ``none``, else an ``OuterState``.

    ``params`` must already be the same on every rank (broadcast from rank 0).

    >>> from fdp import plan_buckets
    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2,), "float32", "cpu")])
    >>> outer = init_outer_state(OuterSpec("local_sgd", 4), {"w": torch.ones(2)}, plan)
    >>> outer.anchor["w"].tolist(), outer.syncs
    ([1.0, 1.0], 0)
    """
    spec = check_outer(spec)
    if spec.name == "none":
        return ()
    anchor = {name: p.detach().clone() for name, p in params.items()}
    return OuterState(anchor, outer_optimizer(spec).init(anchor), init_hook_states(hook or allreduce(), plan), 0)


def is_sync_step(spec: OuterSpec, step: int) -> bool:
    """Whether step ``step`` (counted from 1) ends with an outer sync.

    >>> [s for s in range(1, 13) if is_sync_step(OuterSpec("diloco", 4, 2), s)]
    [6, 10]
    """
    return step > spec.start_step and (step - spec.start_step) % spec.sync_every == 0


class _Alone(Comm):
    """A world of one inside a larger one: every collective completes at once, unsent."""

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0


def make_outer_step(
    loss_fn: Callable,
    optimizer: GradientTransformation,
    plan: BucketPlan,
    spec: OuterSpec,
    hook: Hook | None = None,
    comm: Comm | None = None,
    donate: bool = False,
    **step_options,
) -> Callable[[TrainState, tuple], tuple[TrainState, dict]]:
    """Build ``step(state, batch) -> (new_state, metrics)`` with the outer loop of ``spec``.

    ``state.outer`` must come from ``init_outer_state``. Up to ``spec.start_step`` the
    step is ``make_train_step``'s (gradients reduced through ``hook`` every step); after
    it, each rank steps alone, and every ``spec.sync_every`` steps the pseudo-gradient is
    reduced through ``hook`` over ``plan`` and the outer optimizer moves every rank to
    the new anchor. ``step_options`` (``accum_steps``, ``schedule``, ``nonfinite``,
    ``timeline``) go to ``make_train_step``; ``donate`` as there.

    >>> from fdp import functionalize, init_train_state, plan_buckets, sgd
    >>> from fdp.train import cross_entropy_loss, planner_loss
    >>> model, params, buffers = functionalize(torch.nn.Linear(4, 3))
    >>> loss_fn = cross_entropy_loss(model)
    >>> batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    >>> spec = check_outer({"name": "diloco", "sync_every": 2, "lr": 0.7, "momentum": 0.9, "nesterov": True})
    >>> state = init_train_state(params, buffers, sgd(0.1), plan)
    >>> state = state._replace(outer=init_outer_state(spec, params, plan))
    >>> step = make_outer_step(loss_fn, sgd(0.1), plan, spec)
    >>> for _ in range(4):
    ...     state, metrics = step(state, batch)
    >>> state.step, state.outer.syncs, metrics["synced"]
    (4, 2, 1)
    """
    spec = check_outer(spec)
    if spec.name == "none":
        raise ValueError("outer=none: expected local_sgd or diloco for an outer step (use make_train_step)")
    hook, comm = hook or allreduce(), comm or Comm()
    synced = make_train_step(loss_fn, optimizer, plan, hook, comm, donate=donate, **step_options) if spec.start_step else None
    local = make_train_step(loss_fn, optimizer, plan, allreduce(), _Alone(), donate=donate, **step_options)
    local_hook_states = init_hook_states(allreduce(), plan)
    sync = _make_sync(plan, hook, comm, outer_optimizer(spec), donate)

    def step(state: TrainState, batch: tuple) -> tuple[TrainState, dict]:
        if not isinstance(state.outer, OuterState):
            raise ValueError("state.outer: expected the OuterState of init_outer_state")
        number = state.step + 1
        if number <= spec.start_step:
            new_state, metrics = synced(state, batch)
            outer = state.outer
            if number == spec.start_step:  # per-step sync ends here: the outer loop starts from these params
                outer = outer._replace(anchor={name: p.detach().clone() for name, p in new_state.params.items()})
            return new_state._replace(outer=outer), {**metrics, "synced": 1}
        # The local step keeps no chain state; the configured chain's state is kept for later.
        new_state, metrics = local(state._replace(hook_state=local_hook_states), batch)
        new_state = new_state._replace(hook_state=state.hook_state, outer=state.outer)
        if not is_sync_step(spec, number):
            return new_state, {**metrics, "synced": 0}
        t0 = time.perf_counter()
        new_state, wait_s, sent, count = sync(new_state)
        step_s = metrics["step_s"] + time.perf_counter() - t0
        comm_wait_s = metrics["comm_wait_s"] + wait_s
        return new_state, {
            **metrics, "step_s": step_s, "comm_wait_s": comm_wait_s, "compute_s": step_s - comm_wait_s,
            "bytes_sent": metrics["bytes_sent"] + sent, "collectives": metrics["collectives"] + count, "synced": 1,
        }

    return step


def _make_sync(plan: BucketPlan, hook: Hook, comm: Comm, outer_opt: GradientTransformation, donate: bool):
    flats = allocate(plan)  # scratch for the pseudo-gradient, refilled at every sync
    views = [slot_views(bucket, flat) for bucket, flat in zip(plan.buckets, flats)]
    names = [name for bucket_views in views for name in bucket_views]
    targets = [view for bucket_views in views for view in bucket_views.values()]

    def sync(state: TrainState) -> tuple[TrainState, float, int, int]:
        outer: OuterState = state.outer
        foreach.copy_(targets, [outer.anchor[name] for name in names])
        foreach.add_(targets, [state.params[name] for name in names], alpha=-1.0)
        reduction = Reduction(hook, comm, outer.hook_state, plan)
        for flat in flats:
            reduction.start(flat)
        reduced: dict[str, torch.Tensor] = {}
        for index, bucket in reduction.finished():
            reduced.update(slot_views(plan.buckets[index], bucket.buffer))
        pseudo = {name: reduced[name] for name in outer.anchor}
        # Reduced values are the same on every rank, so every rank raises alike.
        if not bool(torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for g in pseudo.values()])).all()):
            raise FloatingPointError(f"non-finite pseudo-gradient at the outer sync after step {state.step}")
        stats = reduction.stats()
        anchor, opt_state = apply_gradients(outer_opt, pseudo, outer.opt_state, outer.anchor, donate=donate)
        t0 = time.perf_counter()
        buffers = _averaged(state.buffers, comm)
        wait_s = stats.wait_s + time.perf_counter() - t0
        sent, count = comm.take_counters()
        if donate:  # the params are this loop's to overwrite: no new tensors
            foreach.copy_(list(state.params.values()), [anchor[name] for name in state.params])
            params = dict(state.params)
        else:
            params = {name: anchor[name].clone() for name in state.params}
        new_outer = OuterState(anchor, opt_state, reduction.hook_states, outer.syncs + 1)
        return state._replace(params=params, buffers=buffers, outer=new_outer), wait_s, stats.bytes_sent + sent, stats.collectives + count

    return sync


def _averaged(buffers: dict, comm: Comm) -> dict:
    """Floating-point buffers (running statistics) averaged over ranks; the others as they are."""
    world = comm.world_size
    if world == 1:
        return buffers
    floating = [name for name, b in buffers.items() if b.is_floating_point()]
    pending = {name: comm.allreduce(buffers[name] / world) for name in floating}
    return {name: pending[name].wait() if name in pending else b for name, b in buffers.items()}
