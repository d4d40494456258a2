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

``overlap=D`` hides a sync's communication behind the next ``D`` inner steps (a delayed
outer update, as in overlapped local SGD and streaming DiLoCo): the pseudo-gradient is
sent after step ``s`` and each rank trains on meanwhile; after step ``s + D`` the outer
optimizer steps the anchor with the average, and each rank keeps what it learned since
``s`` on top of it (``params += new_anchor - params_at_s``). The pseudo-gradient in
flight is part of the state (``OuterState.in_flight``), so a checkpoint taken inside
those ``D`` steps resumes bit-exactly: the resumed run sends it again.
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
from fdp.optim import GradientTransformation, apply_gradients, apply_updates, sgd
from fdp.plan import BucketPlan
from fdp.hooks import init_hook_states
from fdp.chains import Reduction
from fdp.state import TrainState
from fdp.step import TrainStep, make_train_step

OUTER = ("none", "local_sgd", "diloco")


class OuterSpec(NamedTuple):
    """The outer loop's settings (``conf/outer/*.yaml``); ``name="none"`` syncs every step."""

    name: str = "none"
    sync_every: int = 1
    start_step: int = 0
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    overlap: int = 0


class OuterState(NamedTuple):
    """What the outer loop carries from sync to sync (``TrainState.outer``).

    ``anchor``: the params at the last sync, the same on every rank; ``opt_state``: the
    outer optimizer's state; ``hook_state``: one state per bucket for the pseudo-gradient's
    hook chain; ``syncs``: syncs done so far; ``in_flight``: under ``overlap``, this rank's
    pseudo-gradient of the last sync started (empty without ``overlap``).
    """

    anchor: Params
    opt_state: Any
    hook_state: tuple
    syncs: int
    in_flight: Params = {}


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
    if not 0 <= spec.overlap < spec.sync_every:
        raise ValueError(f"outer.overlap={spec.overlap!r}: expected an integer in [0, outer.sync_every={spec.sync_every})")
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
    in_flight = {name: torch.zeros_like(p) for name, p in anchor.items()} if spec.overlap else {}
    return OuterState(anchor, outer_optimizer(spec).init(anchor), init_hook_states(hook or allreduce(), plan), 0, in_flight)


def is_sync_step(spec: OuterSpec, step: int) -> bool:
    """Whether step ``step`` (counted from 1) ends by sending a pseudo-gradient.

    >>> [s for s in range(1, 13) if is_sync_step(OuterSpec("diloco", 4, 2), s)]
    [6, 10]
    """
    return step > spec.start_step and (step - spec.start_step) % spec.sync_every == 0


def is_landing_step(spec: OuterSpec, step: int) -> bool:
    """Whether step ``step`` ends by applying a sync (``overlap`` steps after it was sent).

    >>> [s for s in range(1, 13) if is_landing_step(OuterSpec("diloco", 4, 2, overlap=1), s)]
    [7, 11]
    """
    return is_sync_step(spec, step - spec.overlap)


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
) -> TrainStep:
    """Build ``step(state, batch) -> (new_state, metrics)`` (a ``TrainStep``) with the outer loop of ``spec``.

    ``state.outer`` must come from ``init_outer_state``. Up to ``spec.start_step`` the
    step is ``make_train_step``'s (gradients reduced through ``hook`` every step); after
    it, each rank steps alone, and every ``spec.sync_every`` steps the pseudo-gradient is
    reduced through ``hook`` over ``plan`` and the outer optimizer moves every rank to
    the new anchor (``spec.overlap`` steps later, with each rank's progress since kept).
    ``step_options`` (the other fields of ``fdp.step.StepOptions``) go to
    ``make_train_step``; ``donate`` as there. Every rank must build its step at the same
    point (with ``overlap``, the syncs get a process group of their own).

    >>> from fdp import functionalize, init_train_state, plan_buckets, sgd
    >>> from fdp.losses import cross_entropy_loss, planner_loss
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
    # Each rank steps alone on its share of the global batch: its samples keep their global numbers.
    local = make_train_step(loss_fn, optimizer, plan, allreduce(), _Alone(), donate=donate,
                            **{"batch_rank": comm.rank, **step_options})
    local_hook_states = init_hook_states(allreduce(), plan)
    # A sync in flight across steps gets a group of its own: the collectives issued
    # meanwhile (a logged loss, a checkpoint's gather) then cannot cross its own.
    sync = _Sync(plan, hook, comm.on_own_group() if spec.overlap else comm, outer_optimizer(spec), donate)
    flight: tuple[Params, Reduction] | None = None  # the sync on the wire: (its OuterState.in_flight, reduction)

    def step(state: TrainState, batch: tuple) -> tuple[TrainState, dict]:
        nonlocal flight
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
        t0, wait_s, sent, count, landed = time.perf_counter(), 0.0, 0, 0, 0
        ours = flight is not None and flight[0] is state.outer.in_flight
        if spec.overlap and is_landing_step(spec, number):
            # Sent `overlap` steps ago by this step function or, for a resumed (or
            # replayed) state, sent again now from the state: the same values either way.
            reduction = flight[1] if ours else sync.launch(state.outer, state.outer.in_flight)
            new_state, wait_s, sent, count = sync.land(new_state, reduction, delayed=True)
            flight, landed = None, 1
        elif ours:
            flight[1].poll()
        if is_sync_step(spec, number):
            if spec.overlap:
                in_flight = sync.pseudo_gradient(new_state.outer, new_state.params)
                flight = (in_flight, sync.launch(new_state.outer, in_flight))
                new_state = new_state._replace(outer=new_state.outer._replace(in_flight=in_flight))
            else:
                reduction = sync.launch_from(new_state.outer, new_state.params)
                new_state, wait_s, sent, count = sync.land(new_state, reduction, delayed=False)
                landed = 1
        # What the sync's own group sent this step: a sync sent, or the next round of one polled on.
        more_sent, more_count = sync.comm.take_counters() if spec.overlap else (0, 0)
        step_s = metrics["step_s"] + time.perf_counter() - t0
        comm_wait_s = metrics["comm_wait_s"] + wait_s
        return new_state, {
            **metrics, "step_s": step_s, "comm_wait_s": comm_wait_s, "compute_s": step_s - comm_wait_s,
            "bytes_sent": metrics["bytes_sent"] + sent + more_sent, "collectives": metrics["collectives"] + count + more_count,
            "synced": landed,
        }

    def settle() -> None:  # read the last step's finiteness verdict, whichever inner step took it
        for inner in (synced, local):
            if inner is not None:
                inner.settle()

    return TrainStep(step, settle)


class _Sync:
    """Sends pseudo-gradients through the plan and hook chain, and steps the anchor with them."""

    def __init__(self, plan: BucketPlan, hook: Hook, comm: Comm, outer_opt: GradientTransformation, donate: bool):
        self.plan, self.hook, self.comm, self.outer_opt, self.donate = plan, hook, comm, outer_opt, donate
        self.flats = allocate(plan)  # scratch the reduction works in, refilled at every sync
        views = [slot_views(bucket, flat) for bucket, flat in zip(plan.buckets, self.flats)]
        self.names = [name for bucket_views in views for name in bucket_views]
        self.targets = [view for bucket_views in views for view in bucket_views.values()]

    def pseudo_gradient(self, outer: OuterState, params: Params) -> Params:
        """``anchor - params``, in ``outer.in_flight``'s tensors when the state is donated."""
        names = list(outer.anchor)
        anchor, current = [outer.anchor[n] for n in names], [params[n] for n in names]
        if self.donate:
            out = [outer.in_flight[n] for n in names]
            foreach.copy_(out, anchor)
            foreach.add_(out, current, alpha=-1.0)
        else:
            out = foreach.add(anchor, current, alpha=-1.0)
        return dict(zip(names, out))

    def launch_from(self, outer: OuterState, params: Params) -> Reduction:
        """Start reducing ``outer.anchor - params``, computed in the bucket buffers."""
        foreach.copy_(self.targets, [outer.anchor[name] for name in self.names])
        foreach.add_(self.targets, [params[name] for name in self.names], alpha=-1.0)
        return self._start(outer)

    def launch(self, outer: OuterState, pseudo: Params) -> Reduction:
        """Start reducing the pseudo-gradient ``pseudo``."""
        foreach.copy_(self.targets, [pseudo[name] for name in self.names])
        return self._start(outer)

    def _start(self, outer: OuterState) -> Reduction:
        reduction = Reduction(self.hook, self.comm, outer.hook_state, self.plan)
        for flat in self.flats:
            reduction.start(flat)
        return reduction

    def land(self, state: TrainState, reduction: Reduction, delayed: bool) -> tuple[TrainState, float, int, int]:
        """Step the anchor with the reduced pseudo-gradient; move the params to it.

        ``delayed``: the sync was sent ``overlap`` steps ago (from ``state.outer.in_flight``),
        and each rank keeps its steps since then on top of the new anchor.
        Returns the new state, the seconds blocked, and the bytes and collectives sent.
        """
        outer: OuterState = state.outer
        reduced: dict[str, torch.Tensor] = {}
        for index, bucket in reduction.finished():
            reduced.update(slot_views(self.plan.buckets[index], bucket.buffer))
        pseudo = {name: reduced[name] for name in outer.anchor}
        # Reduced values are the same on every rank, so every rank raises alike.
        if not bool(torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for g in pseudo.values()])).all()):
            raise FloatingPointError(f"non-finite pseudo-gradient at the outer sync after step {state.step}")
        stats = reduction.stats()
        names = list(state.params)
        if delayed:
            updates, opt_state = self.outer_opt.update(pseudo, outer.opt_state, outer.anchor)
            anchor = apply_updates(outer.anchor, updates)
            # new anchor - params when sent = updates + this rank's pseudo-gradient: small
            # values, added before they meet the params, to lose the least to rounding.
            correction = foreach.add([updates[n] for n in names], [outer.in_flight[n] for n in names])
            if self.donate:
                foreach.add_([state.params[n] for n in names], correction)
                params = dict(state.params)
            else:
                params = dict(zip(names, foreach.add([state.params[n] for n in names], correction)))
        else:
            anchor, opt_state = apply_gradients(self.outer_opt, pseudo, outer.opt_state, outer.anchor, donate=self.donate)
            if self.donate:  # the params are this loop's to overwrite: no new tensors
                foreach.copy_([state.params[n] for n in names], [anchor[n] for n in names])
                params = dict(state.params)
            else:
                params = {n: anchor[n].clone() for n in names}
        t0 = time.perf_counter()
        buffers = _averaged(state.buffers, self.comm)
        wait_s = stats.wait_s + time.perf_counter() - t0
        sent, count = self.comm.take_counters()
        new_outer = OuterState(anchor, opt_state, reduction.hook_states, outer.syncs + 1, outer.in_flight)
        new_state = state._replace(params=params, buffers=buffers, outer=new_outer)
        return new_state, wait_s, stats.bytes_sent + sent, stats.collectives + count


def _averaged(buffers: dict, comm: Comm) -> dict:
    """Floating-point buffers (running statistics) averaged over ranks; the others as they are."""
    world = comm.world_size
    if world == 1:
        return buffers
    floating = [name for name, b in buffers.items() if b.is_floating_point()]
    pending = {name: comm.allreduce(buffers[name] / world) for name in floating}
    return {name: pending[name].wait() if name in pending else b for name, b in buffers.items()}
