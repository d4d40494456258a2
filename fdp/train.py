"""The train state and the pure train step: ``state, batch -> state, metrics``."""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from fdp import checks, replicas
from fdp.buckets import slot_views
from fdp.comm import Comm
from fdp.data import split_micro_batches
from fdp.functional import Buffers, FunctionalModel, Params
from fdp.hooks import GradBucket, Hook, allreduce, checked
from fdp.optim import GradientTransformation, apply_gradients, current_lr, supports_inplace
from fdp.plan import BucketPlan
from fdp.reduce import GradReducer, Reduced, init_hook_states
from fdp.trace import Timeline


NONFINITE = ("raise", "skip")


def _all_finite(flats) -> bool:
    # One reduction per bucket: a NaN or inf anywhere makes the sum non-finite.
    return bool(torch.isfinite(torch.stack([flat.sum(dtype=torch.float32) for flat in flats])).all())


def _first_nonfinite(grads: dict) -> str | None:
    return next((name for name, g in grads.items() if not torch.isfinite(g).all()), None)


def _nonfinite_error(step: int, grads: dict) -> FloatingPointError:
    return FloatingPointError(
        f"non-finite gradient at step {step} in parameter {_first_nonfinite(grads)!r} "
        "(set trainer.nonfinite=skip to skip such steps)"
    )


class _StepEachBucket:
    """The optimizer step for a donated state, bucket by bucket, as the reductions finish.

    Each bucket's params are updated in place while later buckets are still in flight,
    so the optimizer (a pass or two over memory) runs while the network is busy. Only for
    elementwise optimizers, and only where a non-finite gradient may abort the step
    (``nonfinite="raise"``): buckets updated before a non-finite one stay updated.
    """

    def __init__(self, optimizer: GradientTransformation, plan: BucketPlan, state: "TrainState", timeline: Timeline | None):
        self.optimizer, self.plan, self.state, self.timeline = optimizer, plan, state, timeline
        self.new_opt_state = None
        self.nonfinite: dict | None = None  # the first non-finite bucket's gradients

    def __call__(self, index: int, reduced: GradBucket) -> None:
        if self.nonfinite is not None:
            return
        start = self.timeline.now_us() if self.timeline else 0.0
        grads = slot_views(self.plan.buckets[index], reduced.buffer)
        if not _all_finite([reduced.buffer]):
            self.nonfinite = grads
            return
        self.new_opt_state = self.optimizer.update_inplace(grads, self.state.opt_state, self.state.params)
        if self.timeline:
            self.timeline.complete("optimizer", start, self.timeline.now_us(), bucket=index)

    def result(self, state: "TrainState") -> tuple:
        """``(params, opt_state)`` once every bucket is through; raises on a non-finite bucket."""
        if self.nonfinite is not None:
            raise _nonfinite_error(state.step + 1, self.nonfinite)
        opt_state = self.new_opt_state
        if opt_state is None:  # a plan without buckets: nothing to update, the count still moves
            opt_state = self.optimizer.update_inplace({}, state.opt_state, state.params)
        return state.params, opt_state


def _step_whole(
    optimizer: GradientTransformation, reduced: Reduced, state: "TrainState", donate: bool, timeline: Timeline | None
) -> tuple | None:
    """``(params, opt_state)`` from all reduced gradients at once; ``None`` if any is non-finite."""
    if not _all_finite(reduced.flats):
        return None
    start = timeline.now_us() if timeline else 0.0
    stepped = apply_gradients(optimizer, reduced.grads, state.opt_state, state.params, donate=donate)
    if timeline:
        timeline.complete("optimizer", start, timeline.now_us())
    return stepped


class TrainState(NamedTuple):
    """Everything that changes during training, in one value.

    ``hook_state`` holds one state per bucket for the reduction's hook chain; ``rng`` is
    the CPU generator state that dropout and other random ops draw from.
    """

    step: int
    params: Params
    buffers: Buffers
    opt_state: Any
    hook_state: Any
    rng: torch.Tensor


def init_train_state(
    params: Params,
    buffers: Buffers,
    optimizer: GradientTransformation,
    plan: BucketPlan | None = None,
    hook: Hook | None = None,
    seed: int = 0,
) -> TrainState:
    """The state before step 1 (pass ``plan``, and ``hook`` unless it is ``allreduce()``, for a
    state that ``make_train_step`` can step; ``fdp.setup_state`` does this across ranks).

    >>> from fdp import functionalize, sgd
    >>> model, params, buffers = functionalize(torch.nn.Linear(2, 2))
    >>> init_train_state(params, buffers, sgd(0.1)).step
    0
    """
    hook_state = init_hook_states(hook or allreduce(), plan) if plan is not None else ()
    rng = torch.Generator().manual_seed(seed).get_state()
    return TrainState(0, params, buffers, optimizer.init(params), hook_state, rng)


def cross_entropy_loss(model: FunctionalModel) -> Callable:
    """``loss_fn(params, buffers, batch) -> (loss, (new_buffers, metrics))`` for classifiers and LMs.

    Logits of any shape ``(..., classes)`` are scored against targets of shape ``(...)``.
    """

    def loss_fn(params: Params, buffers: Buffers, batch):
        inputs, targets = batch
        logits, new_buffers = model.apply(params, buffers, inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss, (new_buffers, {})

    return loss_fn


def planner_loss(loss_fn: Callable, buffers: Buffers) -> Callable:
    """Adapt a train loss to the planner's ``loss(params, batch)`` signature."""
    return lambda params, batch: loss_fn(params, buffers, batch)[0]


def make_train_step(
    loss_fn: Callable,
    optimizer: GradientTransformation,
    plan: BucketPlan,
    hook: Hook | None = None,
    comm: Comm | None = None,
    accum_steps: int = 1,
    schedule: str = "after",
    nonfinite: str = "raise",
    timeline: Timeline | None = None,
    donate: bool = False,
    sync_buffers: str = "broadcast",
) -> Callable[[TrainState, tuple], tuple[TrainState, dict]]:
    """Build ``train_step(state, batch) -> (new_state, metrics)``.

    The step splits ``batch`` (this rank's share of the global batch) into
    ``accum_steps`` micro-batches, accumulates their gradients in the bucket buffers,
    reduces them once through ``hook`` over ``plan``, and applies ``optimizer``. It never
    modifies ``state``; the same state and batch always give the same result.

    ``donate=True`` is for loops that drop each state once they have the next (as
    ``fdp.trainer`` does): the step may then update the params and optimizer state in
    place (see ``fdp.optim.apply_gradients``), so the old state must not be used again.
    The results are those of ``donate=False`` up to float rounding (torch's fused
    optimizer kernels round a few operations differently). With an elementwise optimizer
    (``sgd``, ``adam``, ``adamw``) and ``nonfinite="raise"``, each bucket's params are
    updated as soon as its reduction is done, while later buckets are still in flight. A
    step that skips leaves ``state`` intact; one that raises leaves a donated state
    partly updated (resume from a checkpoint).

    ``sync_buffers`` says how the state's buffers (BatchNorm running statistics) agree
    across ranks before each forward: ``"broadcast"`` rank 0's (DDP's default),
    ``"average"`` or ``"local"`` (see ``fdp.replicas``). The arguments are checked here
    and the first step's state against ``plan`` and ``hook`` (``fdp.checks``).

    >>> from fdp import functionalize, plan_buckets, sgd
    >>> model, params, buffers = functionalize(torch.nn.Linear(4, 3))
    >>> loss_fn = cross_entropy_loss(model)
    >>> batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    >>> step = make_train_step(loss_fn, sgd(0.1), plan)
    >>> state, metrics = step(init_train_state(params, buffers, sgd(0.1), plan), batch)
    >>> state.step
    1
    """
    checks.check_step_arguments(loss_fn, optimizer, plan, hook, comm, accum_steps, schedule, nonfinite, sync_buffers)
    if nonfinite not in NONFINITE:
        raise ValueError(f"trainer.nonfinite={nonfinite!r}: expected one of {NONFINITE}")
    reducer = GradReducer(loss_fn, plan, checked(hook or allreduce()), comm or Comm(), schedule, timeline)
    steps_each_bucket: bool | None = None  # decided on the first step: params keep their device and dtype

    def train_step(state: TrainState, batch: tuple) -> tuple[TrainState, dict]:
        nonlocal steps_each_bucket
        t0 = time.perf_counter()
        if timeline:
            timeline.step = state.step + 1
        micro_batches = split_micro_batches(batch, accum_steps)
        if steps_each_bucket is None:
            checks.check_state_against_plan(state, plan)
            checks.check_hook_states(state.hook_state, reducer.hook, plan)
            steps_each_bucket = (
                donate and nonfinite == "raise" and optimizer.elementwise and supports_inplace(optimizer, state.params)
            )
        state = state._replace(buffers=replicas.sync_buffers(state.buffers, reducer.comm, sync_buffers))
        each_bucket = _StepEachBucket(optimizer, plan, state, timeline) if steps_each_bucket else None
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state.rng)
            reduced = reducer(state.params, state.buffers, micro_batches, state.hook_state, each_bucket)
            rng = torch.get_rng_state()
        stats = reduced.stats
        loss = torch.stack([l.detach() for l in reduced.losses]).mean()
        # Reduced gradients are identical on every rank, so every decision below is too.
        stepped = each_bucket.result(state) if each_bucket else _step_whole(optimizer, reduced, state, donate, timeline)
        if stepped is not None:
            params, opt_state = stepped
            new_state = TrainState(state.step + 1, params, reduced.auxes[-1][0], opt_state, reduced.hook_states, rng)
        elif nonfinite == "skip":
            new_state = state._replace(step=state.step + 1, rng=rng)
        else:
            raise _nonfinite_error(state.step + 1, reduced.grads)
        finite = stepped is not None
        elapsed = time.perf_counter() - t0
        metrics = {
            "loss": loss,
            "lr": current_lr(new_state.opt_state),
            "skipped": 0 if finite else 1,
            "step_s": elapsed,
            "comm_wait_s": stats.wait_s,
            "compute_s": elapsed - stats.wait_s,
            "bytes_sent": stats.bytes_sent,
            "collectives": stats.collectives,
        }
        return new_state, metrics

    train_step.reducer = reducer
    return train_step
