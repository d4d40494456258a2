"""The training loop of one world: its steps, its saves, and the world shrinking or growing under it.

``Loop`` holds what depends on the world's ranks (the step function, this rank's batches, its checkpoints) and
where the loop stands (the newest state, the one before it); ``Loop.run`` trains to the last step or a stop,
saving when due through the run's ``Checkpointer`` (``fdp.run.checkpoint``: the format, the writes in flight and
the checkpoints kept are its own), calling the run's callbacks at each of these points (``fdp.run.callbacks``);
``Loop.shrink`` goes on without lost ranks (``fdp.procs.shrink``), ``Loop.grow`` admits ranks that asked to join
(``fdp.procs.grow``). ``fdp.run.trainer`` starts it and owns its resources.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from fdp.comm import Comm
from fdp.data import train_batches
from fdp.model import remat
from fdp.model.losses import make_loss_fn
from fdp.procs.allocator import release_free_memory
from fdp.procs.budget import MemoryPhase
from fdp.procs.devices import batch_to_device
from fdp.procs.grow import GrowingWorld
from fdp.procs.interrupt import StopSignals
from fdp.procs.launch import RankLostError
from fdp.procs.shrink import Shrink, ShrinkingWorld, whole_groups
from fdp.run.build import RunParts, node_size_of, regrouped
from fdp.run.callbacks import Callbacks
from fdp.run.checkpoint import Checkpointer
from fdp.run.loop_controls import LoopControls
from fdp.run.memory.micro_batch import AUTO, Agreement, MicroBatchOutOfMemory, budget_mib, fixed_accum, halved
from fdp.run.memory.run_forecast import forecast_accum
from fdp.run.rank_loss import rank_loss_of
from fdp.run.rejoin import heal
from fdp.run.report.records import Report
from fdp.run.rundir import RankStatus, RunDir
from fdp.state.kept import KeptState
from fdp.state.train_state import TrainState
from fdp.step.outer import make_outer_step
from fdp.step.outer_spec import check_outer, join_boundaries
from fdp.step.train_step import TrainStep, make_train_step
from fdp.trace import Timeline
from fdp.update import zero

__all__ = ["Loop", "make_step"]

log = logging.getLogger("fdp")


def make_step(
    cfg: DictConfig,
    parts: RunParts,
    comm: Comm,
    timeline: Timeline,
    compile: bool,
    donate: bool = True,
    accum_steps: int | None = None,
    after_backward=None,
) -> TrainStep:
    """The run's train step (``fdp.step``) for the world of ``comm``, from its settings and pieces; ``accum_steps``
    and ``after_backward``: what ``trainer.accum_steps=auto`` decided (``fdp.run.memory.micro_batch``)."""
    tc = cfg.trainer
    options = dict(
        # donate: the loop never looks at a state again once it has the next (but a world that
        # shrinks may go back to it: fdp.procs.shrink)
        accum_steps=accum_steps or fixed_accum(tc.accum_steps),
        after_backward=after_backward,
        schedule=tc.schedule,
        nonfinite=tc.nonfinite,
        timeline=timeline,
        donate=donate,
        sync_buffers=tc.sync_buffers,
        precision=parts.precision,
        compile=compile,
        update=parts.update,
        # Dropout masks by sample, the same on any number of ranks (fdp.model.streams), or each rank's generator.
        sample_seed=cfg.seed if rank_loss_of(cfg.world).sample_streams(tc.sample_streams) else None,
        checkpoint_modules=remat.from_config(
            tc.activation_checkpointing,
            tc.activation_checkpointing_policy,
            tc.activation_checkpointing_k,
            parts.model.module,
        ),
    )
    loss_fn = make_loss_fn(parts.model, parts.criterion)
    outer = check_outer(OmegaConf.to_container(cfg.outer))
    if outer.name == "none":
        return make_train_step(loss_fn, parts.optimizer, parts.plan, parts.hook, comm, **options)
    return make_outer_step(loss_fn, parts.optimizer, parts.plan, outer, parts.hook, comm, **options)


class Loop:
    """The training loop of one world: what depends on its ranks, and where the loop stands.

    ``state`` is the newest state this rank completed, ``kept`` the one the last step began from (in a world that
    shrinks, ``fdp.state.kept``; else ``None``), ``since`` when the step in flight began.
    """

    def __init__(
        self,
        cfg: DictConfig,
        parts: RunParts,
        comm: Comm,
        timeline: Timeline,
        device: torch.device,
        state: TrainState,
        last_step: int,
        compile: bool,
        controls: LoopControls,
        phase: MemoryPhase,
        world: ShrinkingWorld | None = None,
        callbacks: Callbacks | None = None,
        memory: tuple[float, float] = (0.0, 0.0),
    ):
        self.cfg, self.parts, self.timeline, self.device, self.last_step = cfg, parts, timeline, device, last_step
        self.compile, self.controls, self.phase, self.world = compile, controls, phase, world
        self.callbacks = callbacks or Callbacks(run_dir=".")
        # A world grows at the boundary of an outer-loop period (between steps without one), where no sync is in flight.
        self.boundaries = join_boundaries(check_outer(OmegaConf.to_container(cfg.outer)))
        self.state = state
        loss = rank_loss_of(cfg.world)
        self.donates = loss.donates_state(check_outer(OmegaConf.to_container(cfg.outer)).name != "none")
        self.kept = KeptState(copies=self.donates) if loss.keeps_before else None
        self.since = time.perf_counter()
        self.checkpoints: Checkpointer | None = None
        self.launched = comm.world_size
        # trainer.accum_steps=auto (fdp.run.memory.micro_batch): what the run's memory forecast starts from (the fixed
        # part and the base, MiB), the choice and its records for metrics.jsonl.
        self.memory, self.auto = memory, cfg.trainer.accum_steps == AUTO
        self.accum, self.agreement, self.choices = fixed_accum(cfg.trainer.accum_steps), None, []
        self.join(comm)

    def join(self, comm: Comm) -> None:
        """The step function, this rank's batches and its checkpoints for the world of ``comm``, from ``state`` on."""
        cfg = self.cfg
        self.comm = comm
        # A world that shrank or grew writes over its own groups: the last world's write is complete (grow) or
        # abandoned with that world's groups (shrink; its temporary directory goes at the next save).
        self.checkpoints = Checkpointer(cfg, comm, self.launched)
        if self.auto:  # at start, and again in a world of another size
            self._choose_micro_batch(comm)
        self._make_step()
        self.batches = train_batches(
            self.parts.data,
            cfg.data.global_batch_size,
            cfg.seed,
            comm.rank,
            comm.world_size,
            self.state.step,
            self.last_step,
            cfg.data.get("num_workers", 0),
            pin_memory=self.device.type == "cuda",
        )

    def _make_step(self) -> None:
        """The step function. Under ``trainer.accum_steps=auto`` on its own groups
        (``fdp.run.memory.micro_batch.Agreement``), ``world.hierarchical``'s made again too: a rank waiting in a
        collective of the update or the hook for a rank that ran out of memory is woken as in the step's own, and a
        step abandoned with collectives in flight on them leaves them behind."""
        cfg = self.cfg
        self.train_step = None  # the last one's buffers freed before the next one's are made
        comm = self.agreement.step_comm() if self.agreement is not None else self.comm
        self.step_comm = comm
        if self.agreement is not None and cfg.world.hierarchical:
            self.agreement.abandoned.append(self.parts)  # its groups kept, never used again
            self.parts = regrouped(cfg, self.parts, comm)
            self.controls.shard = self.parts.update.comm
        self.train_step = make_step(
            cfg,
            self.parts,
            comm,
            self.timeline,
            self.compile,
            donate=self.donates,
            accum_steps=self.accum,
            after_backward=self.agreement,
        )

    def _choose_micro_batch(self, comm: Comm) -> None:
        """``trainer.accum_steps=auto``: the largest micro-batch the forecast fits in the budget, the smallest of
        every rank's (a collective); the first step confirms it."""
        began, (fixed_mib, base_mib) = time.perf_counter(), self.memory
        budget = budget_mib(self.cfg, self.device, base_mib)
        accum, why = forecast_accum(self.cfg, self.parts, comm.world_size, fixed_mib, budget)
        release_free_memory()  # what the forecast's trace left free
        if comm.world_size > 1:
            agreed = torch.tensor([accum], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=comm.group)
            accum = int(agreed[0])
        per_rank, tries, fewer = self.cfg.data.global_batch_size // comm.world_size, 1, accum
        while (fewer := halved(per_rank, fewer)) is not None:  # a step group for each micro-batch it may halve to
            tries += 1
        self.agreement = Agreement(comm, self.device, tries)
        self._chose(accum, why, time.perf_counter() - began)

    def _chose(self, accum: int, why: str, seconds: float) -> None:
        """Take ``accum`` micro-batches per step from the next step on; ``seconds``: what deciding it took."""
        self.accum = self.phase.accum = accum
        per_rank = self.cfg.data.global_batch_size // self.comm.world_size
        record = {
            "step": self.state.step,
            "accum_steps": accum,
            "micro_batch": per_rank // accum,
            "why": why,
            "seconds": round(seconds, 3),
        }
        self.choices.append(record)
        if self.comm.rank == 0:
            log.info(
                f"trainer.accum_steps=auto: {accum} micro-batches of {per_rank // accum} samples per step from step "
                f"{self.state.step + 1} on {self.comm.world_size} ranks ({why})"
            )

    def _step(self, batch) -> tuple[TrainState, dict]:
        """One step from ``state`` on ``batch``; under ``trainer.accum_steps=auto`` done again with half the
        micro-batch while its forwards and backwards run out of memory on some rank (the state intact)."""
        while True:
            began = time.perf_counter()
            try:
                return self.train_step(self.state, batch)
            except MicroBatchOutOfMemory as error:
                per_rank = self.cfg.data.global_batch_size // self.comm.world_size
                accum = halved(per_rank, self.accum)
                if accum is None:
                    raise MemoryError(f"{error}, at a micro-batch of one sample") from None
                self.train_step.settle()  # the step before's verdict, where the abandoned one left it unread
                self.agreement.abandoned.append(self.step_comm)
                self.accum = accum
                self._make_step()  # the failed try and the new step function: what halving costs
                self._chose(accum, f"step {self.state.step + 1}: {error}; halved", time.perf_counter() - began)

    def run(self, run_dir: RunDir, report: Report, status: RankStatus, stop: StopSignals) -> str | None:
        """Train to the last step, or to the step a stop signal ends on (returned); ``controls.stopped``
        says why a run ended before its last step without one (``fdp.run.loop_controls``)."""
        tc, controls = self.cfg.trainer, self.controls
        controls.stopped = controls.ended_before()
        while self.state.step < self.last_step and not controls.stopped:
            status.update(self.state.step + 1)
            with self.phase("step", self.state.step + 1):
                self.since = waited = time.perf_counter()  # the data wait: how long the step waited for its batch
                batch = batch_to_device(next(self.batches), self.device)
                waited = time.perf_counter() - waited
                if self.kept is not None:  # a world that shrinks may go back to it (a donated step writes over it)
                    self.kept.keep(self.state)
                state, metrics = self._step(batch)
            self.state = state
            report.parts = self.parts  # made again where a step was abandoned (world.hierarchical's groups)
            while self.choices:  # trainer.accum_steps=auto: the micro-batch chosen, in metrics.jsonl
                report.micro_batch(self.choices.pop(0), self.accum)
            self.callbacks.step_end(self.comm, state, {**metrics, "data_wait_s": waited})
            out_of_time = controls.stepped(state)  # the moving average; max_time, agreed by every rank
            interrupted = stop.agreed()  # every rank, every step: flags are compared every ~0.1 s, no step waits
            due = tc.checkpoint_every and state.step % tc.checkpoint_every == 0 or state.step == self.last_step
            saving = due or interrupted or out_of_time
            # Saved before the step's report, so an evaluation that does not fit loses no step; a run whose
            # checkpoints hold what its evaluation decides (early stopping, the best ones, a callback's state)
            # evaluates first.
            evaluate_first = controls.watches or self.callbacks.evaluate_first
            if saving and not evaluate_first:
                self._save(run_dir, state)
            with self.phase("evaluation", state.step):
                evaluated = report.step(
                    state,
                    {**metrics, "data_wait_s": waited},
                    stopping=interrupted is not None,
                    average=controls.average,
                )
            if evaluated is not None and controls.scheduled(state.step):  # not stop_at's extra one: a resume is exact
                self.callbacks.evaluation_end(self.comm, state, evaluated)
            verdict = controls.evaluated(state.step, evaluated)  # the same on every rank: rank 0's record
            controls.stopped = None if state.step == self.last_step else verdict.stop or out_of_time
            if evaluate_first and (saving or controls.stopped or verdict.keep_best):
                written = self._save(run_dir, state)
                self.checkpoints.keep_best(run_dir.checkpoints, written, state.step, controls.best_names())
            if interrupted:
                return interrupted
            if (
                isinstance(self.world, GrowingWorld)
                and not controls.stopped
                and self.world.due(state.step, *self.boundaries)
            ):
                self.grow(report, stop)
        if controls.stopped and self.comm.rank == 0:
            log.info(f"stopped at step {self.state.step}: {controls.stopped}")
        return None

    def _save(self, run_dir: RunDir, state: TrainState) -> Path | None:
        """Checkpoint ``state`` (its gradients checked finite first), with the loop's own state and the callbacks'."""
        with self.phase("save", state.step):
            self.train_step.settle()  # no checkpoint of a step whose gradients were not finite
            extra = {**self.controls.payload(state.step), **self.callbacks.payload(self.comm)}
            if self.auto:  # what it ran with; a resume decides again (another machine, another budget)
                extra["micro_batch"] = {"accum_steps": self.accum}
            written = self.checkpoints.save(run_dir.checkpoints, state, self.parts.update, self.parts.plan, extra)
        self.phase.saved = True
        if self.callbacks.wants("save", self.comm.rank):
            self.checkpoints.wait()  # a callback hears of a checkpoint once it is complete
            self.callbacks.saved(self.comm, state, written)
        return written

    def grow(self, report: Report, stop: StopSignals) -> None:
        """Admit the ranks that asked to join, at this boundary (``fdp.procs.grow``): a larger world, healed from
        this one, the global batch split again."""
        world, began = self.world, time.perf_counter()
        self.train_step.settle()
        self.checkpoints.wait()  # written by this world, over its groups, before the world changes
        comm = world.admit()
        extra = {"controls": self.controls.payload(self.state.step), "compile": self.compile}
        parts, self.state, _ = heal(self.cfg, world, self.parts, self.state, comm, self.device, extra)
        self.regroup(parts, report)
        if self.kept is not None:
            self.kept.forget()  # kept in the world before: the next step keeps this world's
        record = {
            "step": self.state.step,
            "joined": list(world.joined),
            "world": comm.world_size,
            "seconds": round(time.perf_counter() - began, 3),
            "asked": world.asked_at,
        }
        report.grown(comm, record)
        log.info(
            f"rank {', '.join(map(str, world.joined))} joined: going on from step {self.state.step} on "
            f"{comm.world_size} ranks ({record['seconds']:.1f} s)"
        )
        # The order the joiner makes its groups in: max_time's (fdp.run.loop_controls), the step's, the stop flag's.
        self.controls.join(comm)
        self.join(comm)
        stop.rejoin(comm.world_size, comm.watch)

    def regroup(self, parts: RunParts, report: Report) -> None:
        """Go on with ``parts`` made for a new world (``fdp.run.build.regrouped``): the loop's, its report's and its
        controls' (their evaluations and averages run on the update's groups)."""
        self.parts = report.parts = parts
        self.controls.shard = parts.update.comm

    def shrink(
        self, world: ShrinkingWorld, error: RuntimeError, run_dir: RunDir, report: Report, stop: StopSignals
    ) -> None:
        """Go on without the ranks that stopped answering (``fdp.procs.shrink``); re-raise ``error`` if none did."""
        silent = world.silent()
        if not silent:  # every rank still beats: not a lost rank
            raise error
        world.report_broken()  # the others' collectives may wait on a live peer: they end now
        self.checkpoints.abandon()  # a write in flight needs the lost rank: it ends before this world's groups do
        members = set(world.members)
        leaving = whole_groups(world.members, silent, node_size_of(self.cfg))  # a lost rank's node steps out whole
        if world.me in leaving:
            log.info(f"rank {world.me} steps out with its node: rank {', '.join(map(str, silent))} was lost")
        comm = world.regroup(leaving)
        lost = tuple(sorted(members - set(world.members)))
        step = world.agree_on_step(self.state.step, comm)
        if self.state.step != step:  # this rank finished the step its peers dropped
            self.controls.back()
        if self.kept.step == step:  # back to the state that step began with (a step that failed part way wrote over it)
            self.state = self.kept.take()
        self.kept.forget()
        self.regroup(regrouped(self.cfg, self.parts, comm), report)
        try:
            self.state = self.parts.update.reshard(self.state, tuple(sorted(members)), world.members, comm)
        except zero.LostSlices as lost_slices:
            raise RankLostError(
                f"rank {', '.join(map(str, sorted(members - set(world.members))))} lost at step "
                f"{step + 1}: {lost_slices}; continue from the last checkpoint "
                "(trainer.resume=true)"
            ) from None
        shrink = Shrink(step, lost, comm.world_size, time.perf_counter() - self.since)
        report.shrunk(comm, shrink.record())
        gone = sorted(r for record in report.shrinks for r in record["lost"])
        log.info(
            f"rank {', '.join(map(str, lost))} lost: going on from step {step} on {comm.world_size} ranks "
            f"({shrink.seconds_lost:.1f} s lost)"
        )
        if comm.world_size < self.cfg.world.min_ranks:
            # The run ends here: the checkpoint is complete before it does.
            final = Checkpointer(self.cfg, comm, self.launched, asynchronous=False)
            final.save(run_dir.checkpoints, self.state, self.parts.update, self.parts.plan)
            raise RankLostError(
                f"rank {', '.join(map(str, gone))} lost by step {step + 1}: {comm.world_size} left, fewer than "
                f"world.min_ranks={self.cfg.world.min_ranks}; the last checkpoint is step {step} "
                "(continue with trainer.resume=true)"
            )
        self.controls.join(comm)  # max_time's clock goes on in the smaller world
        stop.rejoin(comm.world_size, comm.watch)
        self.join(comm)
