"""The pure train step: ``state, batch -> state, metrics``.

``make_train_step`` builds it from a loss, an optimizer, a bucket plan and a hook chain.
One step reads top to bottom in ``TrainStep``'s function below: buffers agree across
ranks, backward fills the bucket buffers (starting each bucket's hook chain as it
fills, under the ``overlap`` schedule), the reduction hands the buckets back as their
chains finish and the update (``fdp.update.base``: stage 0, or a ZeRO stage of
``fdp.update.zero``) takes each one, the finiteness verdict decides whether the step counts,
and the update's ``finish`` gives the new params and optimizer state.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, NamedTuple

import torch

from fdp.comm import Comm
from fdp.data import split_micro_batches
from fdp.data.batches import batch_size
from fdp.errors import check_bool, check_choice, require
from fdp.hooks import Hook, allreduce, for_slices, with_result_checks
from fdp.model import recompute, remat, streams_functions
from fdp.model.functional import FunctionalModel
from fdp.model.losses import weigh_micro_batches
from fdp.model.precision import Precision, scaled_micro_batches, unscale, unscaled_loss, update_loss_scale
from fdp.model.streams import SampleStreams
from fdp.optim import GradientTransformation, current_lr
from fdp.plan import BucketPlan
from fdp.procs.devices import device_of, rng_scope
from fdp.state import checks, replicas
from fdp.state.train_state import TrainState, state_nbytes
from fdp.step.reduce import GradReducer, resolve_schedule
from fdp.step.verdicts import DeferredVerdicts
from fdp.trace import NullTimeline, Timeline
from fdp.update.base import Update
from fdp.update.zero import check_zero_stage, update_for

__all__ = ["NONFINITE", "StepOptions", "TrainStep", "check_nonfinite", "make_train_step"]

NONFINITE = ("raise", "skip")


def check_nonfinite(nonfinite: str) -> str:
    """What a step does on a non-finite gradient: ``raise`` (name it) or ``skip`` (on every rank alike).

    >>> check_nonfinite("ignore")
    Traceback (most recent call last):
    ...
    ValueError: nonfinite='ignore': expected raise or skip
    """
    return check_choice("nonfinite", nonfinite, NONFINITE)


class StepOptions(NamedTuple):
    """How a train step runs; every field is checked once, by the module that uses it (``resolved()``).

    * ``accum_steps``: micro-batches per step; their gradients are accumulated in the
      bucket buffers and reduced once.
    * ``schedule``: when the reduction starts: ``after`` backward, ``overlap`` with it
      (each bucket as soon as it is full), or ``auto`` (overlap on more than one process).
    * ``nonfinite``: ``raise`` or ``skip`` a step whose reduced gradients are not finite.
      On a GPU ``raise`` does not stop the host to read the verdict: a non-finite
      gradient at step s raises from the call for step s + 1 (naming step s), or from
      ``TrainStep.settle()``; on the CPU the step itself raises, naming the parameter.
    * ``donate``: the caller drops each state once it has the next (``fdp.run.trainer``
      does), so the step may update params and optimizer state in place with torch's
      fused kernels (see ``fdp.optim.apply_gradients``); an elementwise optimizer then
      steps each bucket the moment its reduction is done. Results are those of
      ``donate=False`` up to float rounding. A skipped step leaves ``state`` intact; one
      that raises leaves a donated state partly updated (resume from a checkpoint).
    * ``sync_buffers``: how buffers (BatchNorm statistics) agree across ranks before each
      forward: ``broadcast`` rank 0's (DDP's default), ``average`` or ``local`` (``fdp.state.replicas``).
    * ``precision``: an ``fdp.model.precision.Precision`` (autocast, bf16 weights, loss scaling;
      under ``16-mixed`` an overflowing step is skipped on every rank alike, keeping the
      forward's buffers, BatchNorm statistics, as torch's ``GradScaler`` does; under
      ``bf16-mixed`` stage 3 gathers params in bf16 and ``Precision.reduce_dtype`` is the
      dtype gradients are averaged in).
    * ``compile``: the gradient computation under ``torch.compile`` (``fdp.step.compiled``).
    * ``zero_stage``: 1 shards the optimizer state over the ranks, 2 the reduced
      gradients too, 3 the params too (``fdp.update.zero``); the state must then come from
      ``fdp.update.zero.init_state`` or ``fdp.update.zero.shard_state`` for that stage.
    * ``model``: the ``FunctionalModel`` the loss runs; stage 3 needs it, to gather each
      bucket's params before its modules read them.
    * ``reshard_after_forward``: stage 3 releases each bucket's params after the forward
      and gathers them again for backward (``False``: keeps them from the forward to
      their last gradient: more memory, half the gathers).
    * ``update``: an ``fdp.update.base.Update`` already made for this run (``fdp.update.zero.update_for``,
      as ``fdp.run.build`` makes it), in place of ``zero_stage``, ``model`` and
      ``reshard_after_forward``.
    * ``timeline``: an ``fdp.trace.Timeline`` to record spans into.
    * ``sample_seed``: dropout and the forward's other batch-shaped random ops draw each
      sample's values from its own stream, keyed by this seed, the step and the sample's
      index in the global batch (``fdp.model.streams``), so they do not depend on the world size;
      ``None``: from the state's generators (``TrainState.rng``, each rank's own).
    * ``checkpoint_modules``: modules whose activations backward recomputes instead of
      keeping them from the forward (``fdp.model.remat``, ``fdp.model.recompute``): the modules themselves, their
      classes or class names (found in ``model``), or ``"blocks"`` (the model's repeated blocks).
    * ``batch_rank``: which share of the global batch this rank's batch is (its first
      sample is number ``batch_rank * len(batch)``); ``None``: ``comm``'s rank.
    * ``after_backward``: called once the micro-batches' forwards and backwards are done, before anything of
      the state is written (even a donated one: the optimizer steps the buckets only after it), with the error
      they raised or ``None``; it raises to abandon the step with ``state`` intact, or returns to go on
      (``fdp.run.memory.micro_batch``: every rank agrees there on whether one ran out of memory). ``None``: an error
      in backward is raised as it is.
    """

    accum_steps: int = 1
    schedule: str = "after"
    nonfinite: str = "raise"
    donate: bool = False
    sync_buffers: str = "broadcast"
    precision: Precision | None = None
    compile: bool = False
    zero_stage: int = 0
    model: FunctionalModel | None = None
    reshard_after_forward: bool = True
    update: Update | None = None
    timeline: Timeline | None = None
    sample_seed: int | None = None
    batch_rank: int | None = None
    checkpoint_modules: Any = ()
    after_backward: Callable[[BaseException | None], None] | None = None

    def resolved(self) -> "StepOptions":
        """These options with their defaults filled in; a ``ValueError`` naming the first bad one.

        >>> StepOptions(accum_steps=0).resolved()
        Traceback (most recent call last):
        ...
        ValueError: accum_steps=0: expected an integer >= 1
        """
        checks.check_accum_steps(self.accum_steps)
        resolve_schedule(self.schedule, world_size=1)
        check_nonfinite(self.nonfinite)
        replicas.check_sync_buffers(self.sync_buffers)
        check_zero_stage(self.zero_stage)
        check_bool("reshard_after_forward", self.reshard_after_forward)
        for name, least in (("sample_seed", None), ("batch_rank", 0)):
            value = getattr(self, name)
            whole = isinstance(value, int) and not isinstance(value, bool) and (least is None or value >= least)
            require(value is None or whole, name, value, "None or an integer" + (" >= 0" if least is not None else ""))
        require(
            self.update is None or isinstance(self.update, Update),
            "update",
            self.update,
            "None or an fdp.update.base.Update (fdp.update.zero.update_for)",
            TypeError,
        )
        require(
            self.update is None or self.zero_stage in (0, self.update.stage),
            "zero_stage",
            self.zero_stage,
            f"{self.update.stage if self.update else 0} (the stage of the update given) or 0",
        )
        return self._replace(precision=self.precision or Precision(), timeline=self.timeline or NullTimeline())


class TrainStep(NamedTuple):
    """``train_step(state, batch) -> (new_state, metrics)``, ``settle()`` and ``abandon()``.

    ``settle()`` reads the last step's finiteness verdict where the step left it unread
    (on a GPU, so as not to stall the device) and raises if it was not finite: call it
    before keeping a state for good (a checkpoint, the end of a run). ``abandon()``: the step
    is not run again (its world changed): what it left on the model (stage 3's gather hooks) goes.
    """

    run: Callable[[TrainState, Any], tuple[TrainState, dict]]
    settle: Callable[[], None]
    abandon: Callable[[], None] = lambda: None

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        return self.run(state, batch)

    @property
    def step(self) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
        """``run``, by the name it had before ``step`` came to mean the step's number alone."""
        return self.run


def make_train_step(
    loss_fn: Callable,
    optimizer: GradientTransformation,
    plan: BucketPlan,
    hook: Hook | None = None,
    comm: Comm | None = None,
    **options: Any,
) -> TrainStep:
    """Build ``train_step(state, batch) -> (new_state, metrics)`` (a ``TrainStep``).

    The step splits ``batch`` (this rank's share of the global batch) into micro-batches,
    accumulates their gradients in the bucket buffers, reduces them once through
    ``hook`` over ``plan``, and applies ``optimizer``. It never modifies ``state`` unless
    it is donated; the same state and batch always give the same result. ``options``
    are the fields of ``StepOptions``. The arguments are checked here and the first
    step's state against ``plan`` and ``hook`` (``fdp.state.checks``).

    >>> from fdp import functionalize, init_train_state, plan_buckets, sgd
    >>> from fdp.model.losses import cross_entropy_loss, planner_loss
    >>> model, params, buffers = functionalize(torch.nn.Linear(4, 3))
    >>> loss_fn = cross_entropy_loss(model)
    >>> batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    >>> plan = plan_buckets(planner_loss(loss_fn, buffers), params, batch)
    >>> train_step = make_train_step(loss_fn, sgd(0.1), plan)
    >>> state, metrics = train_step(init_train_state(params, buffers, sgd(0.1), plan), batch)
    >>> state.step
    1
    """
    checks.check_step_arguments(loss_fn, optimizer, plan, hook, comm)
    opts = StepOptions(**options).resolved()
    comm, hook = comm or Comm(), with_result_checks(opts.precision.reducing(hook or allreduce()))
    stage_update = opts.update or update_for(
        opts.zero_stage,
        optimizer,
        plan,
        comm,
        model=opts.model,
        reshard_after_forward=opts.reshard_after_forward,
        gather_dtype=opts.precision.gather_dtype,
    )
    refusal = stage_update.refuses_optimizer(optimizer)
    require(not refusal, "optimizer", optimizer.update, f"another optimizer ({refusal})", TypeError)
    early = opts.donate and opts.nonfinite == "raise"
    update = stage_update.for_step(comm, opts.timeline, opts.donate, early)
    hook = update.reduction_hook(hook)  # hybrid sharding: the chain runs across the groups, on each rank's slice
    streams = SampleStreams(opts.sample_seed) if opts.sample_seed is not None else None
    batch_rank = comm.rank if opts.batch_rank is None else opts.batch_rank
    checkpointed = remat.modules_of(opts.checkpoint_modules, opts.model) if opts.checkpoint_modules else []
    # A step compiled whole traces its streams; elsewhere they are a function mode too, the dispatch mode where
    # the first forward draws out of a function mode's sight (fdp.model.streams_functions; streams.compile_refusal).
    traced = streams is not None and opts.compile and not update.gather.gathers and not checkpointed
    forward_loss = (
        (streams_functions.traced if traced else streams_functions.by_function)(streams, loss_fn)
        if streams
        else loss_fn
    )
    if checkpointed:
        forward_loss = recompute.checkpointed(forward_loss, checkpointed)
    reducer = GradReducer(
        opts.precision.wrap(forward_loss),
        plan,
        for_slices(hook),  # where the comm keeps a slice of each bucket, a hook that makes it whole keeps its slice
        update.reduction_comm(comm),
        opts.schedule,
        opts.timeline,
        compile=opts.compile,
        release_buffers=update.release_buffers,
        gather=update.gather,
        flat_params=update.flat_params,
        eager_modules=checkpointed,  # their recomputation runs under torch.func, which refuses compiled code
        around_compiled=functools.partial(streams_functions.taking, streams) if traced else None,
    )
    verdicts = DeferredVerdicts()
    state_verified, state_mib = False, None

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        nonlocal state_verified, state_mib
        t0 = time.perf_counter()
        number = state.step + 1
        opts.timeline.start_step(number)
        if not state_verified:
            update.check_state(state)  # the params it steps, and that the ranks start from the same ones
            checks.check_hook_states(state.hook_state, hook, plan)
            if opts.donate:  # params as one flat buffer per bucket, where the reducer hands them over so
                state = state._replace(params=reducer.laid_out(state.params))
            state_verified = True
        state = state._replace(buffers=replicas.sync_buffers(state.buffers, comm, opts.sync_buffers))
        step_update = update.begin(state, reducer.flats)
        with rng_scope(state.rng, state.cuda_rng, device_of(state.params)) as rng_states:
            micro_batches = split_micro_batches(batch, opts.accum_steps)
            if streams is not None:
                streams.begin(
                    number,
                    batch_rank * batch_size(batch),
                    [batch_size(b) for b in micro_batches],
                    device_of(state.params),
                )
            micro_batches = weigh_micro_batches(loss_fn, micro_batches, comm)
            micro_batches = scaled_micro_batches(micro_batches, state.loss_scale)
            failed = None
            # A slice stepped in place inside backward is stepped for good: not where a failed step is redone.
            early_slices = step_update.steps_in_backward and opts.after_backward is None
            try:
                computed = reducer.backward(
                    step_update.params,
                    state.buffers,
                    micro_batches,
                    state.hook_state,
                    on_reduced=functools.partial(_take, step_update, state.loss_scale) if early_slices else None,
                )
            except Exception as error:  # noqa: BLE001 - after_backward decides: raised as it is, or abandoned
                if opts.after_backward is None:
                    raise
                failed = error
            if failed is None:
                rng, cuda_rng = rng_states()
        if opts.after_backward is not None:
            del micro_batches  # a failed step's tensors are the caller's to free (failed's frames hold the rest)
            try:
                opts.after_backward(failed)
            except BaseException:
                update.gather.abandon()  # stage 3: this step function's gathers are done with
                raise
            if failed is not None:  # it let the error stand
                raise failed
        for index, bucket in computed.reduction.finished():
            _take(step_update, state.loss_scale, index, bucket)

        # Reduced gradients agree on every rank, so every rank takes the same branch.
        # Skipping needs the verdict now (the step's one host synchronisation); raising
        # can read it later, so the host goes on queueing work for the device.
        ok = step_update.verdict()
        skipped = False
        if opts.nonfinite == "raise" and state.loss_scale is None:
            verdicts.record(ok, _explain(number, step_update))
        else:
            skipped = not bool(ok.all())
        loss_scale = (
            None
            if state.loss_scale is None
            else update_loss_scale(state.loss_scale, not skipped, opts.precision.growth_interval)
        )
        if skipped:  # nonfinite="skip", or loss scaling
            # An overflow of the scaled gradients says nothing of the forward: its buffers
            # (BatchNorm statistics) are kept, as torch's GradScaler keeps them.
            buffers = computed.buffers if state.loss_scale is not None else state.buffers
            new_state = state._replace(step=number, buffers=buffers, rng=rng, cuda_rng=cuda_rng, loss_scale=loss_scale)
        else:
            params, opt_state = step_update.finish()
            new_state = TrainState(
                number,
                params,
                computed.buffers,
                opt_state,
                computed.reduction.hook_states,
                rng,
                cuda_rng,
                loss_scale,
                state.outer,
                step_update.mirror,
            )
        if state_mib is None:  # what this rank holds between steps (params, optimizer state, bucket buffers): fixed
            state_mib = state_nbytes(new_state, reducer.flats) / 2**20
        return new_state, _metrics(
            t0, computed, step_update, new_state, state.loss_scale, loss_scale, skipped, state_mib
        )

    return TrainStep(train_step, verdicts.settle, update.gather.abandon)


def _take(step_update: Any, loss_scale: Any, index: int, bucket: Any) -> None:
    """Hand bucket ``index``'s reduced gradient, unscaled, to the step's update."""
    step_update.reduced(index, unscale(bucket.buffer, loss_scale, bucket.owned))


def _explain(number: int, step_update: Any) -> Callable[[bool], FloatingPointError]:
    """The error for step ``number``'s non-finite gradient, stage_update only when there is one."""

    def explain(late: bool) -> FloatingPointError:
        return FloatingPointError(
            f"non-finite gradient at step {number} in {step_update.nonfinite_where(late)} "
            "(set trainer.nonfinite=skip to skip such steps)"
        )

    return explain


def _mean_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    # One micro-batch's loss is its own mean: no stack and mean to issue for it.
    return losses[0].detach() if len(losses) == 1 else torch.stack([loss.detach() for loss in losses]).mean()


def _metrics(
    t0: float,
    computed: Any,
    step_update: Any,
    new_state: TrainState,
    scale_before: Any,
    scale_after: Any,
    skipped: bool,
    state_mib: float,
) -> dict:
    stats = computed.reduction.stats()
    wait_s = stats.wait_s + step_update.wait_s
    elapsed = time.perf_counter() - t0
    metrics = {
        "loss": unscaled_loss(_mean_loss(computed.losses), scale_before),
        "grad_norm": step_update.grad_norm(),  # of the reduced gradient, before clipping: the same on every rank
        "lr": current_lr(new_state.opt_state),
        "skipped": int(skipped),
        "step_s": elapsed,
        "comm_wait_s": wait_s,
        "compute_s": elapsed - wait_s,
        "bytes_sent": stats.bytes_sent,
        "collectives": stats.collectives,
        "state_mib": state_mib,
    }
    if scale_after is not None:
        metrics["loss_scale"] = scale_after.scale
    return metrics
