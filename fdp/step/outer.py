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

``fragments=F`` is streaming DiLoCo (Douillard et al. 2025): the plan's buckets are cut
into F contiguous runs balanced by size (``fdp.plan.split_fragments``), each with its own
outer optimizer state, and fragment f syncs after the steps ``s`` with
``(s - start_step - offset_f) % sync_every == 0`` (``fdp.step.outer_spec``), so one sync
moves 1/F of the model; ``overlap`` then applies to each fragment's sync. ``mix=a``
lands a sync as ``a * local + (1 - a) * new anchor`` (the paper's and torchft's alpha)
instead of keeping the steps since the send. One fragment with no ``mix`` is the loop
above, to the bit. The settings' defaults live in ``fdp.run.config`` (``DiLoCoConfig``), their
checks in ``fdp.step.outer_spec``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch

from fdp._torch import foreach
from fdp.comm import Alone, Comm
from fdp.hooks import Hook, allreduce, init_hook_states
from fdp.model.functional import Params
from fdp.optim import GradientTransformation, apply_gradients, apply_updates, sgd
from fdp.plan import BucketPlan, fragment_plan, split_fragments
from fdp.plan.buckets import allocate, slot_views
from fdp.state.train_state import TrainState
from fdp.step.chains import Reduction
from fdp.step.outer_spec import (
    OuterSpec,
    check_outer,
    landing_fragment,
    sending_fragment,
)
from fdp.step.train_step import TrainStep, make_train_step
from fdp.update.replica import Replica


class OuterState(NamedTuple):
    """What the outer loop carries from sync to sync (``TrainState.outer``).

    ``anchor``: the params at each fragment's last sync, the same on every rank;
    ``opt_state``: one outer optimizer state per fragment; ``hook_state``: one state per
    bucket for the pseudo-gradient's hook chain; ``syncs``: fragment syncs landed so far;
    ``in_flight``: under ``overlap``, this rank's pseudo-gradient of the last sync started
    (its fragment's entries; empty without ``overlap``).
    """

    anchor: Params
    opt_state: tuple
    hook_state: tuple
    syncs: int
    in_flight: Params = {}


def outer_optimizer(spec: OuterSpec) -> GradientTransformation:
    """The optimizer that steps the anchor with the averaged pseudo-gradient.

    >>> outer_optimizer(OuterSpec("diloco", 16, 0, 0.7, 0.9, True, 0, 1, "strided", None)).elementwise
    True
    """
    return sgd(spec.lr, momentum=spec.momentum, nesterov=spec.nesterov)


def init_outer_state(spec: OuterSpec, params: Params, plan: BucketPlan, hook: Hook | None = None) -> Any:
    """``TrainState.outer`` before step 1: ``()`` for ``none``, else an ``OuterState``.

    ``params`` must already be the same on every rank (broadcast from rank 0).

    >>> from fdp.plan import pack_into_buckets
    >>> plan = pack_into_buckets([("w", (2,), "float32", "cpu")])
    >>> spec = OuterSpec("local_sgd", 4, 0, 1.0, 0.0, False, 0, 1, "strided", None)
    >>> outer = init_outer_state(spec, {"w": torch.ones(2)}, plan)
    >>> outer.anchor["w"].tolist(), outer.syncs
    ([1.0, 1.0], 0)
    """
    spec = check_outer(spec)
    if spec.name == "none":
        return ()
    anchor = {name: p.detach().clone() for name, p in params.items()}
    in_flight = {name: torch.zeros_like(p) for name, p in anchor.items()} if spec.overlap else {}
    opt = outer_optimizer(spec)
    opt_state = tuple(opt.init({name: anchor[name] for name in names}) for names in _fragment_names(plan, spec, anchor))
    return OuterState(anchor, opt_state, init_hook_states(hook or allreduce(), plan), 0, in_flight)


def _fragment_names(plan: BucketPlan, spec: OuterSpec, anchor: Params) -> list[list[str]]:
    """Each fragment's param names, in the anchor's order."""
    fragments = split_fragments(plan, spec.fragments)
    where = {name: f for f, buckets in enumerate(fragments) for i in buckets for name in plan.buckets[i].names}
    missing = [name for name in anchor if name not in where]
    if missing:
        raise ValueError(f"params {missing[:3]} are not in the bucket plan: expected the plan of these params")
    return [[name for name in anchor if where[name] == f] for f in range(len(fragments))]


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
    ``step_options`` (the other fields of ``fdp.step.train_step.StepOptions``) go to
    ``make_train_step``; ``donate`` as there. Every rank must build its step at the same
    point (with ``overlap``, the syncs get a process group of their own).

    >>> from fdp import functionalize, init_train_state, plan_buckets, sgd
    >>> from fdp.model.losses import cross_entropy_loss, planner_loss
    >>> model, params, buffers = functionalize(torch.nn.Linear(4, 3))
    >>> loss_fn = cross_entropy_loss(model)
    >>> batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    >>> spec = OuterSpec("diloco", 2, 0, 0.7, 0.9, True, 0, 1, "strided", None)
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
    synced = (
        make_train_step(loss_fn, optimizer, plan, hook, comm, donate=donate, **step_options)
        if spec.start_step
        else None
    )
    # A replica steps alone between syncs (a rank, or a hybrid-sharded group with ZeRO's update inside it:
    # fdp.update.replica), and syncs its pieces (the whole params, or the group's slices) with the other replicas.
    update = step_options.get("update")
    replica = update.replica() if update is not None else Replica(None, plan)
    inner_options = step_options if replica.inner is None else {**step_options, "update": replica.inner}
    # Each rank steps on its share of the global batch: its samples keep their global numbers.
    local = make_train_step(
        loss_fn, optimizer, plan, allreduce(), Alone(), donate=donate, **{"batch_rank": comm.rank, **inner_options}
    )
    local_hook_states = init_hook_states(allreduce(), plan)
    # A sync in flight across steps gets a group of its own: the collectives issued
    # meanwhile (a logged loss, a checkpoint's gather) then cannot cross its own.
    sync_comm = replica.sync_comm(comm, bool(spec.overlap))
    sync = _Sync(
        replica.plan, spec, hook, sync_comm, outer_optimizer(spec), donate, replica.buffers_comm(comm, sync_comm)
    )
    flight: tuple[Params, Reduction] | None = None  # the sync on the wire: (its OuterState.in_flight, reduction)

    def step(state: TrainState, batch: tuple) -> tuple[TrainState, dict]:
        nonlocal flight
        if not isinstance(state.outer, OuterState) or len(state.outer.opt_state) != spec.fragments:
            raise ValueError(
                f"state.outer: expected the OuterState of init_outer_state with outer.fragments={spec.fragments}"
            )
        number = state.step + 1
        if number <= spec.start_step:
            new_state, metrics = synced(state, batch)
            outer = state.outer
            if number == spec.start_step:  # per-step sync ends here: the outer loop starts from these params
                pieces = replica.pieces(new_state.params)
                outer = outer._replace(anchor={name: p.detach().clone() for name, p in pieces.items()})
            return new_state._replace(outer=outer), {**metrics, "synced": 1}
        # The local step keeps no chain state; the configured chain's state is kept for later.
        new_state, metrics = local(state._replace(hook_state=local_hook_states), batch)
        new_state = new_state._replace(hook_state=state.hook_state, outer=state.outer)
        t0, wait_s, sent, count, landed = time.perf_counter(), 0.0, 0, 0, 0
        ours = flight is not None and flight[0] is state.outer.in_flight
        landing = landing_fragment(spec, number) if spec.overlap else None
        sending = sending_fragment(spec, number)
        # A sync works on this rank's pieces of the params (under hybrid sharding, its slices: fdp.update.replica).
        whole = new_state.params
        if landing is not None or sending is not None:
            new_state = new_state._replace(params=replica.pieces(whole))
        if landing is not None:
            # Sent `overlap` steps ago by this step function or, for a resumed (or
            # replayed) state, sent again now from the state: the same values either way.
            reduction = flight[1] if ours else sync.launch(landing, state.outer, state.outer.in_flight)
            new_state, wait_s, sent, count = sync.land(landing, new_state, reduction, delayed=True)
            flight, landed = None, 1
        elif ours:
            flight[1].poll()
        if sending is not None:
            if spec.overlap:
                in_flight = sync.pseudo_gradient(sending, new_state.outer, new_state.params)
                flight = (in_flight, sync.launch(sending, new_state.outer, in_flight))
                new_state = new_state._replace(outer=new_state.outer._replace(in_flight=in_flight))
            else:
                reduction = sync.launch_from(sending, new_state.outer, new_state.params)
                new_state, wait_s, sent, count = sync.land(sending, new_state, reduction, delayed=False)
                landed = 1
        if landed:
            new_state = new_state._replace(params=replica.placed(whole, new_state.params, donate))
        else:
            new_state = new_state._replace(params=whole)
        # What the sync's own group sent this step: a sync sent, or the next round of one polled on.
        more_sent, more_count = sync.comm.take_counters() if spec.overlap else (0, 0)
        step_s = metrics["step_s"] + time.perf_counter() - t0
        comm_wait_s = metrics["comm_wait_s"] + wait_s
        return new_state, {
            **metrics,
            "step_s": step_s,
            "comm_wait_s": comm_wait_s,
            "compute_s": step_s - comm_wait_s,
            "bytes_sent": metrics["bytes_sent"] + sent + more_sent,
            "collectives": metrics["collectives"] + count + more_count,
            "synced": landed,
        }

    def settle() -> None:  # read the last step's finiteness verdict, whichever inner step took it
        for inner in (synced, local):
            if inner is not None:
                inner.settle()

    return TrainStep(step, settle)


class _Fragment(NamedTuple):
    """One fragment's part of the sync: its buckets, their plan, scratch buffers and param views."""

    buckets: range
    plan: BucketPlan
    flats: list
    names: list  # param names, bucket by bucket, as the views
    targets: list  # views of the params' slots in ``flats``


class _Sync:
    """Sends fragments' pseudo-gradients through the plan and hook chain, and steps the anchor with them."""

    def __init__(
        self,
        plan: BucketPlan,
        spec: OuterSpec,
        hook: Hook,
        comm: Comm,
        outer_opt: GradientTransformation,
        donate: bool,
        buffers_comm: Comm | None = None,
    ):
        self.hook, self.comm, self.outer_opt, self.donate, self.mix = hook, comm, outer_opt, donate, spec.mix
        self.buffers_comm = buffers_comm or comm  # the ranks the buffers are averaged over
        flats = allocate(plan)  # scratch the reduction works in, refilled at every sync
        self.fragments = []
        for buckets in split_fragments(plan, spec.fragments):
            views = [slot_views(plan.buckets[i], flats[i]) for i in buckets]
            self.fragments.append(
                _Fragment(
                    buckets,
                    fragment_plan(plan, buckets),
                    [flats[i] for i in buckets],
                    [name for bucket_views in views for name in bucket_views],
                    [view for bucket_views in views for view in bucket_views.values()],
                )
            )

    def pseudo_gradient(self, fragment: int, outer: OuterState, params: Params) -> Params:
        """``outer.in_flight`` with the fragment's entries set to ``anchor - params``
        (in ``outer.in_flight``'s tensors when the state is donated)."""
        names = self.fragments[fragment].names
        anchor, current = [outer.anchor[n] for n in names], [params[n] for n in names]
        if self.donate:
            out = [outer.in_flight[n] for n in names]
            foreach.copy_(out, anchor)
            foreach.add_(out, current, alpha=-1.0)
        else:
            out = foreach.add(anchor, current, alpha=-1.0)
        return {**outer.in_flight, **dict(zip(names, out))}

    def launch_from(self, fragment: int, outer: OuterState, params: Params) -> Reduction:
        """Start reducing the fragment's ``outer.anchor - params``, computed in the bucket buffers."""
        part = self.fragments[fragment]
        foreach.copy_(part.targets, [outer.anchor[name] for name in part.names])
        foreach.add_(part.targets, [params[name] for name in part.names], alpha=-1.0)
        return self._start(part, outer)

    def launch(self, fragment: int, outer: OuterState, pseudo: Params) -> Reduction:
        """Start reducing the fragment's entries of the pseudo-gradient ``pseudo``."""
        part = self.fragments[fragment]
        foreach.copy_(part.targets, [pseudo[name] for name in part.names])
        return self._start(part, outer)

    def _start(self, part: _Fragment, outer: OuterState) -> Reduction:
        states = tuple(outer.hook_state[i] for i in part.buckets)
        reduction = Reduction(self.hook, self.comm, states, part.plan)
        for flat in part.flats:
            reduction.start(flat)
        return reduction

    def land(
        self, fragment: int, state: TrainState, reduction: Reduction, delayed: bool
    ) -> tuple[TrainState, float, int, int]:
        """Step the fragment's anchor with its reduced pseudo-gradient; move its params to it.

        ``delayed``: the sync was sent ``overlap`` steps ago (from ``state.outer.in_flight``);
        each rank keeps its steps since then on top of the new anchor, or (with ``mix``)
        mixes its params now with the new anchor.
        Returns the new state, the seconds blocked, and the bytes and collectives sent.
        """
        outer: OuterState = state.outer
        part = self.fragments[fragment]
        reduced: dict[str, torch.Tensor] = {}
        for index, bucket in reduction.finished():
            reduced.update(slot_views(part.plan.buckets[index], bucket.buffer))
        names = [name for name in outer.anchor if name in reduced]
        pseudo = {name: reduced[name] for name in names}
        # Reduced values are the same on every rank, so every rank raises alike.
        if not bool(torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for g in pseudo.values()])).all()):
            raise FloatingPointError(f"non-finite pseudo-gradient at the outer sync after step {state.step}")
        stats = reduction.stats()
        anchor_part = {n: outer.anchor[n] for n in names}
        local = [state.params[n] for n in names]
        if delayed and self.mix is None:
            updates, opt_state = self.outer_opt.update(pseudo, outer.opt_state[fragment], anchor_part)
            new_anchor = apply_updates(anchor_part, updates)
            # new anchor - params when sent = updates + this rank's pseudo-gradient: small
            # values, added before they meet the params, to lose the least to rounding.
            correction = foreach.add([updates[n] for n in names], [outer.in_flight[n] for n in names])
            if self.donate:
                foreach.add_(local, correction)
                moved = local
            else:
                moved = foreach.add(local, correction)
        else:
            new_anchor, opt_state = apply_gradients(
                self.outer_opt, pseudo, outer.opt_state[fragment], anchor_part, donate=self.donate
            )
            landed = [new_anchor[n] for n in names]
            if self.mix:  # a * local + (1 - a) * anchor, as Streaming DiLoCo mixes
                moved = foreach.mul(local, self.mix)
                foreach.add_(moved, landed, alpha=1.0 - self.mix)
                if self.donate:
                    foreach.copy_(local, moved)
                    moved = local
            elif self.donate:  # the params are this loop's to overwrite: no new tensors
                foreach.copy_(local, landed)
                moved = local
            else:
                moved = [t.clone() for t in landed]
        params = {**state.params, **dict(zip(names, moved))}
        anchor = {**outer.anchor, **new_anchor}
        opt_states = outer.opt_state[:fragment] + (opt_state,) + outer.opt_state[fragment + 1 :]
        hook_state = list(outer.hook_state)
        for i, new in zip(part.buckets, reduction.hook_states):
            hook_state[i] = new
        t0 = time.perf_counter()
        buffers = _averaged(state.buffers, self.buffers_comm)
        wait_s = stats.wait_s + time.perf_counter() - t0
        sent, count = self.comm.take_counters()
        if self.buffers_comm is not self.comm:
            sent, count = (a + b for a, b in zip((sent, count), self.buffers_comm.take_counters()))
        new_outer = OuterState(anchor, opt_states, tuple(hook_state), outer.syncs + 1, outer.in_flight)
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
