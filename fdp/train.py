"""The train state and the pure train step: ``state, batch -> state, metrics``."""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from fdp import checks, replicas
from fdp.buckets import crosses_flat, lay_out
from fdp.comm import Comm
from fdp.data import split_micro_batches
from fdp.devices import device_of, rng_scope, seeded_cuda_rng
from fdp.functional import Buffers, FunctionalModel, Params
from fdp.hooks import Hook, allreduce, checked
from fdp.optim import GradientTransformation, apply_gradients, current_lr, supports_inplace
from fdp.plan import BucketPlan
from fdp.precision import LossScale, Precision, scaled_micro_batches, unscale, unscaled_loss, update_loss_scale
from fdp.reduce import GradReducer, init_hook_states
from fdp.trace import NullTimeline, Timeline
from fdp.zero import ShardedUpdate, check_zero_stage, state_nbytes


NONFINITE = ("raise", "skip")


def check_nonfinite(nonfinite: str) -> str:
    """What a step does on a non-finite gradient: ``raise`` (name it) or ``skip`` (on every rank alike)."""
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite={nonfinite!r}: expected raise or skip")
    return nonfinite


def _finite(flat: torch.Tensor) -> torch.Tensor:
    # One reduction per bucket, kept on the device: a NaN or inf anywhere makes the sum non-finite.
    return torch.isfinite(flat.sum(dtype=torch.float32))


def _mean_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    # One micro-batch's loss is its own mean: no stack and mean to issue for it.
    return losses[0].detach() if len(losses) == 1 else torch.stack([loss.detach() for loss in losses]).mean()


class _Verdict(NamedTuple):
    ok: torch.Tensor  # on the host (pinned when copied from a GPU): all True when every gradient was finite
    copied: Any  # the CUDA event behind the copy
    explain: Callable[[bool], FloatingPointError]  # the error; its argument says whether it comes a step late


class _FiniteChecks:
    """``nonfinite="raise"``: each step's verdict on its reduced gradients, read without stalling the device.

    Reading a flag from a GPU at once waits for everything the host has queued, the
    whole step: the GPU then idles while the host prepares the next one. The flags are
    copied to pinned host memory behind an event instead and read once the event is
    done, at the latest when the next step has queued its work. So at most one step's
    verdict is unread when a step returns; on the CPU none is (the flags are ready at
    once). ``settle`` reads the last one.
    """

    def __init__(self):
        self._unread: _Verdict | None = None

    def record(self, ok: torch.Tensor, explain: Callable[[bool], FloatingPointError]) -> None:
        """Take a step's flags (``explain(late)`` makes its error); raise for it, or for the step before."""
        self.settle()
        if ok.device.type == "cpu":
            if not bool(ok.all()):
                raise explain(False)
            return
        host = torch.empty(ok.shape, dtype=ok.dtype, pin_memory=True)
        host.copy_(ok, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._unread = _Verdict(host, copied, explain)

    def settle(self) -> None:
        """Wait for the unread verdict, if any; raise if that step's gradients were non-finite."""
        verdict, self._unread = self._unread, None
        if verdict is not None:
            verdict.copied.synchronize()
            if not bool(verdict.ok.all()):
                raise verdict.explain(True)


def _explain_nonfinite(step: int, plan: BucketPlan, flags: torch.Tensor, grads: dict, shards) -> Callable[[bool], FloatingPointError]:
    """The error for step ``step``'s non-finite gradient, made only when there is one."""

    def explain(late: bool) -> FloatingPointError:
        if shards is not None:  # ZeRO: this rank knows its own slices
            where = shards.nonfinite_where()
        elif late:  # read a step later, when the bucket buffers hold the next step's gradients
            bucket = plan.buckets[int((~flags).nonzero()[0])]
            where = f"bucket {bucket.index} ({', '.join(bucket.names[:3])}{', ...' if len(bucket.names) > 3 else ''})"
        else:
            where = f"parameter {next(name for name in plan.names if not torch.isfinite(grads[name]).all())!r}"
        return FloatingPointError(f"non-finite gradient at step {step} in {where} (set trainer.nonfinite=skip to skip such steps)")

    return explain


class TrainState(NamedTuple):
    """Everything that changes during training, in one value.

    ``hook_state`` holds one state per bucket for the reduction's hook chain; ``rng`` is
    the CPU generator state that dropout and other random ops draw from, ``cuda_rng``
    that of the params' GPU (empty when they are not on one); ``loss_scale`` the dynamic
    ``LossScale`` of ``16-mixed`` precision (``None`` otherwise); ``outer`` the
    outer loop's state when training syncs only every few steps (``fdp.outer``).
    """

    step: int
    params: Params
    buffers: Buffers
    opt_state: Any
    hook_state: Any
    rng: torch.Tensor
    cuda_rng: torch.Tensor = torch.empty(0, dtype=torch.uint8)
    loss_scale: LossScale | None = None
    outer: Any = ()


def init_train_state(
    params: Params,
    buffers: Buffers,
    optimizer: GradientTransformation,
    plan: BucketPlan | None = None,
    hook: Hook | None = None,
    seed: int = 0,
    precision: Precision | None = None,
) -> TrainState:
    """The state before step 1 (pass ``plan``, and ``hook`` unless it is ``allreduce()``, for a
    state that ``make_train_step`` can step; ``fdp.setup_state`` does this across ranks).

    With ``plan``, where the step hands ``torch.func`` one flat buffer per bucket
    (``fdp.buckets.crosses_flat``), the state's params are copies laid out that way.

    >>> from fdp import functionalize, sgd
    >>> model, params, buffers = functionalize(torch.nn.Linear(2, 2))
    >>> init_train_state(params, buffers, sgd(0.1)).step
    0
    """
    hook_state = init_hook_states(hook or allreduce(), plan) if plan is not None else ()
    if plan is not None:
        params = _laid_out(plan, params)
    rng = torch.Generator().manual_seed(seed).get_state()
    cuda_rng = seeded_cuda_rng(seed, device_of(params))
    loss_scale = precision.init_loss_scale(device_of(params)) if precision is not None else None
    return TrainState(0, params, buffers, optimizer.init(params), hook_state, rng, cuda_rng, loss_scale)


def _laid_out(plan: BucketPlan, params: Params) -> Params:
    # One flat buffer per bucket where the step hands those to torch.func; params the plan
    # was not made for are left as they are, for the first step to name what is wrong.
    try:
        checks.check_state_against_plan(TrainState(0, params, {}, None, None, None), plan)
    except (TypeError, ValueError):
        return params
    return lay_out(plan, params) if crosses_flat(plan) else params


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
    precision: Precision | None = None,
    compile: bool = False,
    zero_stage: int = 0,
) -> Callable[[TrainState, tuple], tuple[TrainState, dict]]:
    """Build ``train_step(state, batch) -> (new_state, metrics)``.

    The step splits ``batch`` (this rank's share of the global batch) into
    ``accum_steps`` micro-batches, accumulates their gradients in the bucket buffers,
    reduces them once through ``hook`` over ``plan``, and applies ``optimizer``. It never
    modifies ``state``; the same state and batch always give the same result.

    ``schedule`` says when the reduction starts: ``after`` backward, ``overlap`` with it
    (each bucket as soon as it is full), or ``auto`` (overlap on more than one process).

    ``donate=True`` is for loops that drop each state once they have the next (as
    ``fdp.trainer`` does): the step may then update the params and optimizer state in
    place (see ``fdp.optim.apply_gradients``), so the old state must not be used again.
    The results are those of ``donate=False`` up to float rounding (torch's fused
    optimizer kernels round a few operations differently). With an elementwise optimizer
    (``sgd``, ``adam``, ``adamw``) and ``nonfinite="raise"``, each bucket's params are
    updated as soon as its reduction is done, while later buckets are still in flight. A
    step that skips leaves ``state`` intact; one that raises leaves a donated state
    partly updated (resume from a checkpoint).

    ``nonfinite="raise"`` does not stop the host to read a GPU's verdict: a non-finite
    gradient at step s raises from the call for step s + 1 (naming step s), or from
    ``train_step.settle()``, which reads the last step's verdict; call it before keeping
    a state for good (``fdp.trainer`` does before each checkpoint and at the end). On
    the CPU the step itself raises, naming the first non-finite parameter.

    ``sync_buffers`` says how the state's buffers (BatchNorm running statistics) agree
    across ranks before each forward: ``"broadcast"`` rank 0's (DDP's default),
    ``"average"`` or ``"local"`` (see ``fdp.replicas``). The arguments are checked here
    and the first step's state against ``plan`` and ``hook`` (``fdp.checks``).

    ``precision`` (``fdp.precision``) wraps ``loss_fn`` in autocast; under loss scaling
    (``16-mixed``, with ``init_train_state(..., precision=...)``) a step whose reduced
    gradients overflow is skipped on every rank alike and counted, whatever
    ``nonfinite`` says, and the state's ``LossScale`` moves on. ``compile=True`` compiles
    the gradient computation with ``torch.compile`` (see ``fdp.compiled``).
    ``zero_stage`` 1 or 2 shards the optimizer state (and, at 2, the reduced gradients)
    over the ranks, ZeRO-style (see ``fdp.zero``); the state must then come from
    ``fdp.zero.init_state`` or ``fdp.zero.shard_state``.

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
    checks.check_step_arguments(loss_fn, optimizer, plan, hook, comm, accum_steps)
    check_nonfinite(nonfinite)
    replicas.check_sync_buffers(sync_buffers)
    check_zero_stage(zero_stage)
    comm = comm or Comm()
    timeline = timeline or NullTimeline()
    precision = precision or Precision()
    sharded = ShardedUpdate(optimizer, plan, comm, zero_stage, timeline) if zero_stage else None
    reducer = GradReducer(
        precision.wrap(loss_fn), plan, checked(hook or allreduce()), sharded.reduction_comm() if sharded else comm,
        schedule, timeline, compile=compile,
    )
    if sharded is not None:
        sharded.hold_grad_buffers(reducer.flats)
    per_bucket: bool | None = None  # decided on the first step: params keep their device and dtype
    deferred: _FiniteChecks | None = None  # with nonfinite="raise" and nothing to skip
    state_mib: float | None = None

    def train_step(state: TrainState, batch: tuple) -> tuple[TrainState, dict]:
        nonlocal per_bucket, state_mib, deferred
        t0 = time.perf_counter()
        step = state.step + 1
        timeline.start_step(step)
        if per_bucket is None:
            checks.check_state_against_plan(state, plan)
            checks.check_hook_states(state.hook_state, reducer.hook, plan)
            if donate and sharded is None:  # params as one flat buffer per bucket: fewer tensors to cross torch.func
                state = state._replace(params=reducer.laid_out(state.params))
            # A loss-scaled step may still be skipped once every bucket is in: no early updates.
            per_bucket = (donate and nonfinite == "raise" and state.loss_scale is None and optimizer.elementwise
                          and supports_inplace(optimizer, state.params))
            if nonfinite == "raise" and state.loss_scale is None:
                deferred = _FiniteChecks()
        state = state._replace(buffers=replicas.sync_buffers(state.buffers, comm, sync_buffers))
        shards = sharded.begin(state, in_place=donate) if sharded is not None else None
        with rng_scope(state.rng, state.cuda_rng, device_of(state.params)) as rng_states:
            micro_batches = scaled_micro_batches(split_micro_batches(batch, accum_steps), state.loss_scale)
            computed = reducer.backward(state.params, state.buffers, micro_batches, state.hook_state)
            rng, cuda_rng = rng_states()

        # Buckets come back as their chains finish; with per-bucket updates each one's
        # params are stepped while later buckets are still on the wire.
        reduced, finite, opt_state = [{}] * len(plan.buckets), [], state.opt_state
        for index, bucket in computed.reduction.finished():
            buffer = unscale(bucket.buffer, state.loss_scale, bucket.owned)
            if shards is not None:  # ZeRO: this rank steps (and all-gathers) its slice of the bucket
                shards.reduced(index, buffer, per_bucket)
                continue
            reduced[index] = reducer.grad_views(index, buffer)
            finite.append(_finite(buffer))
            if per_bucket:
                with timeline.span("optimizer", bucket=index):
                    opt_state = optimizer.update_inplace(reduced[index], state.opt_state, state.params)
        grads = {name: grad for bucket_grads in reduced for name, grad in bucket_grads.items()}  # in plan order

        # Reduced gradients are identical on every rank, so every rank takes the same
        # branch. Skipping needs the verdict now (the step's one host synchronisation);
        # raising can wait for it, so the host goes on queueing work for the device.
        ok = shards.verdict() if shards is not None else torch.stack(finite)
        skipped = False
        if deferred is not None:
            deferred.record(ok, _explain_nonfinite(step, plan, ok, grads, shards))
        else:
            skipped = not bool(ok.all())
        loss_scale = None
        if state.loss_scale is not None:
            loss_scale = update_loss_scale(state.loss_scale, not skipped, precision.growth_interval)
        if not skipped:
            params = state.params
            if shards is not None:
                params, opt_state = shards.finish()
            elif not per_bucket:
                with timeline.span("optimizer"):
                    params, opt_state = apply_gradients(optimizer, grads, state.opt_state, state.params, donate=donate)
            new_state = TrainState(step, params, computed.buffers, opt_state, computed.reduction.hook_states, rng, cuda_rng, loss_scale)
        else:  # nonfinite="skip", or loss scaling: "raise" leaves the verdict to _FiniteChecks
            new_state = state._replace(step=step, rng=rng, cuda_rng=cuda_rng, loss_scale=loss_scale)

        if state_mib is None:  # what this rank holds between steps (params, optimizer state, gradient buffers): fixed
            state_mib = state_nbytes(new_state, sharded.grad_buffers() if sharded else reducer.flats) / 2**20
        stats = computed.reduction.stats()
        if shards is not None:
            stats = stats._replace(wait_s=stats.wait_s + shards.wait_s)
        elapsed = time.perf_counter() - t0
        metrics = {
            "loss": unscaled_loss(_mean_loss(computed.losses), state.loss_scale),
            "lr": current_lr(new_state.opt_state),
            "skipped": int(skipped),
            "step_s": elapsed,
            "comm_wait_s": stats.wait_s,
            "compute_s": elapsed - stats.wait_s,
            "bytes_sent": stats.bytes_sent,
            "collectives": stats.collectives,
            "state_mib": state_mib,
        }
        if loss_scale is not None:
            metrics["loss_scale"] = loss_scale.scale
        return new_state, metrics

    train_step.settle = lambda: deferred.settle() if deferred is not None else None
    return train_step
