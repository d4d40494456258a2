"""From a config to a trained, logged and checkpointed run, on one process or many.

``main(cfg, run_dir)`` is what ``recipes/train.py`` calls: ``run`` validates the config,
starts the workers of a local world with the elastic launcher (or runs in this process),
and each one runs ``train_worker``: join the world, build the run's pieces
(``fdp.build``), resume or start, and loop over the steps (``_train``, ``_Loop``). Under
``world.on_rank_loss=shrink`` a lost rank does not end the loop: the survivors regroup and
go on from the last step they all completed (``_Loop.shrink``, ``fdp.shrink``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from fdp import checkpoint, compiled, remat, zero
from fdp.allocator import release_free_memory, tune_allocator
from fdp.build import RunParts, build_run, display_name, mirrors
from fdp.comm import Comm
from fdp.data import check_global_batch, train_batches
from fdp.devices import batch_to_device, is_out_of_memory, limit_memory
from fdp.errors import ConfigError
from fdp.interrupt import StopSignals, stop_signal_names
from fdp.keeper import LostRank
from fdp.launch import (
    Heartbeat,
    RankLostError,
    RankOutOfMemoryError,
    WorkerFailedError,
    init_distributed,
    launch_rank,
    spawn,
)
from fdp.losses import make_loss_fn
from fdp.metrics import summary_line
from fdp.outer import check_outer, make_outer_step
from fdp.precision import set_matmul_precision
from fdp.report import Report
from fdp.rundir import RankStatus, RunDir, own_run_dir, train_log_handler
from fdp.shrink import Shrink, ShrinkingWorld, check_shrinkable_batch, keep_rank, launched_world, shrink_store
from fdp.state import TrainState
from fdp.step import TrainStep, make_train_step
from fdp.streams import wants_sample_streams
from fdp.trace import NullTimeline, Timeline
from fdp.validate import validate
from fdp.world import layout_of, resolve_world

__all__ = ["main", "run", "train_worker"]

log = logging.getLogger("fdp")


# -- checkpoints of the run -----------------------------------------------------------------
def _save(run_dir: RunDir, state: TrainState, comm: Comm, cfg: DictConfig, parts: RunParts) -> None:
    if cfg.trainer.zero_stage:  # saved whole (by rank 0), so that any world size and stage can resume it
        state = zero.gather_state(state, parts.plan, comm, to=0)
    extra = {"config": OmegaConf.to_yaml(cfg)}
    checkpoint.save_checkpoint(run_dir.checkpoints, state, parts.plan, comm, keep=cfg.trainer.keep_checkpoints, extra=extra)


def _resume(cfg: DictConfig, run_dir: RunDir, parts: RunParts, comm: Comm, stage: int) -> TrainState:
    template = zero.unsharded_template(parts.state, parts.optimizer, parts.plan) if stage else parts.state
    state = checkpoint.load_checkpoint(run_dir.last_checkpoint, template, parts.plan, comm)
    return zero.shard_state(state, parts.plan, comm, stage, mirror=mirrors(cfg)) if stage else state


def _first_state(cfg: DictConfig, run_dir: RunDir, parts: RunParts, comm: Comm) -> TrainState:
    """The built state, or the last checkpoint's when resuming (asked, or after a restart of the world)."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if cfg.trainer.resume or (restarted and run_dir.last_checkpoint.exists()):
        return _resume(cfg, run_dir, parts, comm, cfg.trainer.zero_stage)
    return parts.state


# -- the parts of a worker's run ---------------------------------------------------------------
def _announce(cfg: DictConfig, run_dir: RunDir, parts: RunParts, world: int, device: torch.device) -> None:
    plan = parts.plan
    run_dir.plan_table.write_text(f"{plan}\nfingerprint: {plan.fingerprint()}\n")
    run_dir.plan_json.write_text(json.dumps(plan.to_dict(), indent=1))
    log.info(
        f"{display_name(cfg.model)}: {parts.num_params:,} parameters in {len(plan)} buckets "
        f"({plan.nbytes / 2**20:.2f} MiB, plan {plan.fingerprint()[:12]}, see plan.txt), world {world} on {device}"
        + (f" over {dist.get_backend()}" if dist.is_initialized() else "")
    )


def _make_step(cfg: DictConfig, parts: RunParts, comm: Comm, timeline: Timeline, compile: bool,
               donate: bool = True) -> TrainStep:
    tc = cfg.trainer
    options = dict(
        # donate: the loop never looks at a state again once it has the next (but a world that
        # shrinks may go back to it: fdp.shrink)
        accum_steps=tc.accum_steps, schedule=tc.schedule, nonfinite=tc.nonfinite, timeline=timeline, donate=donate,
        sync_buffers=tc.sync_buffers, precision=parts.precision, compile=compile, zero_stage=tc.zero_stage,
        model=parts.model, reshard_after_forward=tc.reshard_after_forward,
        # Dropout masks by sample, the same on any number of ranks (fdp.streams), or each rank's generator.
        sample_seed=cfg.seed if wants_sample_streams(tc.sample_streams, cfg.world.on_rank_loss) else None,
        checkpoint_modules=remat.from_config(tc.activation_checkpointing, tc.activation_checkpointing_policy,
                                             tc.activation_checkpointing_k, parts.model.module),
    )
    loss_fn = make_loss_fn(parts.model, parts.criterion)
    outer = check_outer(OmegaConf.to_container(cfg.outer))
    if outer.name == "none":
        return make_train_step(loss_fn, parts.optimizer, parts.plan, parts.hook, comm, **options)
    return make_outer_step(loss_fn, parts.optimizer, parts.plan, outer, parts.hook, comm, **options)


def _not_compiled(cfg: DictConfig) -> str | None:
    """Why this run's step cannot compile (what ``trainer.compile=auto`` says), or ``None``."""
    if cfg.trainer.zero_stage == 3:
        return "trainer.zero_stage=3 gathers params in module hooks, which do not compile"
    if wants_sample_streams(cfg.trainer.sample_streams, cfg.world.on_rank_loss):
        return "per-sample random streams (trainer.sample_streams) run in a dispatch mode, which does not compile"
    return None


def _lost_rank_error(error: RuntimeError, heartbeat: Heartbeat | None, rank: int, step: int) -> RankLostError | None:
    """After a failed collective: a ``RankLostError`` naming the ranks that stopped answering, if any."""
    lost = heartbeat.silent_ranks() if heartbeat is not None else None
    if not lost:
        return None
    # Gloo prefixes its messages with its source location: "[.../pair.cc:537] Read error ...".
    reason = re.sub(r"^\[[^\]]*\]\s*", "", (str(error).strip().splitlines() or [""])[0])
    names = ", ".join(map(str, lost))
    return RankLostError(
        f"rank {names} was lost at step {step}: it stopped answering (killed, hung or unreachable); "
        f"the collective on rank {rank} failed with: {reason}"
    )


def _setup_logging(run_dir: RunDir, rank: int) -> None:
    handler: logging.Handler
    if rank == 0:
        handler = logging.StreamHandler(sys.stdout)
    else:
        handler = logging.FileHandler(run_dir.rank_log(rank))
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s"))
    for old in log.handlers:
        old.close()
    # What rank 0 prints also goes to Hydra's <run dir>/train.log (fdp.rundir).
    log.handlers[:] = [handler, train_log_handler(run_dir.path, f"[rank{rank}] ")] if rank == 0 else [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


# -- the worker -------------------------------------------------------------------------------
def train_worker(cfg: DictConfig, run_dir: str) -> dict | LostRank:
    """Train on this rank until ``trainer.max_steps``; return the summary (rank 0's is the one printed).

    Under ``world.on_rank_loss=shrink`` this process keeps the rank as its child
    (``fdp.keeper``) and returns ``LostRank`` for a rank the world went on without
    (under ``torchrun`` and SLURM, the run's summary once the others are done).
    """
    cfg = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
    if cfg.world.on_rank_loss == "shrink" and launched_world(cfg.world.launcher).world_size > 1:
        return keep_rank(_rank_worker, cfg, run_dir, launcher=cfg.world.launcher, timeout_s=cfg.world.timeout_s)
    return _rank_worker(cfg, run_dir)


train_worker.handles_stop_signals = True  # fdp.launch.spawn: it installs fdp.interrupt's handlers itself


def _rank_worker(cfg: DictConfig, run_dir: str) -> dict:
    tune_allocator(sharded_params=cfg.trainer.zero_stage == 3)
    layout = layout_of(cfg)
    comm = init_distributed(layout)
    device = layout.device(int(os.environ.get("LOCAL_RANK", 0)))
    limit_memory(cfg.world.memory_per_rank_mb, device)
    status = RunDir(Path(run_dir))
    world = None
    if cfg.world.on_rank_loss == "shrink" and comm.world_size > 1:
        world = ShrinkingWorld(shrink_store(cfg.world.timeout_s), comm.rank, comm.world_size, dist.get_backend(),
                               cfg.world.timeout_s, cfg.world.min_ranks)
        comm = world.comm()
    try:
        return _train(cfg, status, comm, device, world)
    except (MemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        step = RankStatus.read(status, comm.rank).get("step")
        raise RankOutOfMemoryError(_out_of_memory_message(cfg, comm.rank, step, error)) from None
    finally:
        if world is not None:
            world.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _out_of_memory_message(cfg: DictConfig, rank: int, step: int | None, error: BaseException) -> str:
    where = f"at step {step}" if step else "while building the run"
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    reason = re.sub(r"^\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?", "", reason)
    budget = cfg.world.memory_per_rank_mb
    within = f"world.memory_per_rank_mb={budget:g}" if budget else "this machine's memory"
    return (f"rank {rank} ran out of memory {where} ({reason}); the run does not fit {within}: expected more ranks, "
            f"a higher trainer.zero_stage (now {cfg.trainer.zero_stage}; 3 shards the params too), "
            + ("" if cfg.trainer.activation_checkpointing != "none" else "trainer.activation_checkpointing=blocks ")
            + "or a smaller model")


class _Loop:
    """The training loop of one world: what depends on its ranks, and where the loop stands.

    ``state`` is the newest state this rank completed, ``before`` the one before it (kept
    for a world that shrinks: the step is pure there), ``since`` when the step in flight began.
    """

    def __init__(self, cfg: DictConfig, parts: RunParts, comm: Comm, timeline: Timeline, device: torch.device,
                 state: TrainState, last_step: int, compile: bool):
        self.cfg, self.parts, self.timeline, self.device, self.last_step = cfg, parts, timeline, device, last_step
        self.compile = compile
        self.state = self.before = state
        self.since = time.perf_counter()
        self.join(comm)

    def join(self, comm: Comm) -> None:
        """The step function and this rank's batches for the world of ``comm``, from ``state`` on."""
        cfg = self.cfg
        self.comm = comm
        self.train_step = _make_step(cfg, self.parts, comm, self.timeline, self.compile,
                                     donate=cfg.world.on_rank_loss != "shrink")
        self.batches = train_batches(self.parts.data, cfg.data.global_batch_size, cfg.seed, comm.rank, comm.world_size,
                                     self.state.step, self.last_step, cfg.data.get("num_workers", 0),
                                     pin_memory=self.device.type == "cuda")

    def run(self, run_dir: RunDir, report: Report, status: RankStatus, stop: StopSignals) -> str | None:
        """Train to the last step, or to the step a stop signal ends on (returned)."""
        tc = self.cfg.trainer
        while self.state.step < self.last_step:
            status.update(self.state.step + 1)
            self.since = waited = time.perf_counter()  # the data wait: how long the step waited for its batch
            batch = batch_to_device(next(self.batches), self.device)
            waited = time.perf_counter() - waited
            state, metrics = self.train_step(self.state, batch)
            self.before, self.state = self.state, state
            interrupted = stop.agreed()  # every rank, every step: flags are compared every ~0.1 s, no step waits
            report.step(state, {**metrics, "data_wait_s": waited}, stopping=interrupted is not None)
            if tc.checkpoint_every and state.step % tc.checkpoint_every == 0 or state.step == self.last_step or interrupted:
                self.train_step.settle()  # no checkpoint of a step whose gradients were not finite
                _save(run_dir, state, self.comm, self.cfg, self.parts)
            if interrupted:
                return interrupted
        return None

    def shrink(self, world: ShrinkingWorld, error: RuntimeError, run_dir: RunDir, report: Report,
               stop: StopSignals) -> None:
        """Go on without the ranks that stopped answering (``fdp.shrink``); re-raise ``error`` if none did."""
        silent = world.silent()
        if not silent:  # every rank still beats: not a lost rank
            raise error
        world.report_broken()  # the others' collectives may wait on a live peer: they end now
        members = set(world.members)
        comm = world.regroup(silent)
        lost = tuple(sorted(members - set(world.members)))
        step = world.agree_on_step(self.state.step, comm)
        if self.state.step != step:  # this rank finished the step its peers dropped: back to the one before
            self.state = self.before
        if self.cfg.trainer.zero_stage:
            try:
                self.state = zero.reshard_survivors(self.state, self.parts.plan, tuple(sorted(members)), world.members, comm)
            except zero.LostSlices as lost_slices:
                raise RankLostError(f"rank {', '.join(map(str, sorted(members - set(world.members))))} lost at step "
                                    f"{step + 1}: {lost_slices}; continue from the last checkpoint "
                                    "(trainer.resume=true)") from None
        self.before = self.state
        shrink = Shrink(step, lost, comm.world_size, time.perf_counter() - self.since)
        report.shrunk(comm, shrink.record())
        gone = sorted(r for record in report.shrinks for r in record["lost"])
        log.info(f"rank {', '.join(map(str, lost))} lost: going on from step {step} on {comm.world_size} ranks "
                 f"({shrink.seconds_lost:.1f} s lost)")
        if comm.world_size < self.cfg.world.min_ranks:
            _save(run_dir, self.state, comm, self.cfg, self.parts)
            raise RankLostError(
                f"rank {', '.join(map(str, gone))} lost by step {step + 1}: {comm.world_size} left, fewer than "
                f"world.min_ranks={self.cfg.world.min_ranks}; the last checkpoint is step {step} "
                "(continue with trainer.resume=true)"
            )
        stop.rejoin(comm.world_size, comm.watch)
        self.join(comm)


def _train(cfg: DictConfig, run_dir: RunDir, comm: Comm, device: torch.device, world: ShrinkingWorld | None = None) -> dict:
    rank, world_size, tc = comm.rank, comm.world_size, cfg.trainer
    _setup_logging(run_dir, rank)
    set_matmul_precision(tc.matmul_precision)  # process-wide: set once, before anything runs
    try:
        check_global_batch(cfg.data.global_batch_size, world_size)  # under torchrun the world is known only here
        if world is not None:
            check_shrinkable_batch(cfg.data.global_batch_size, world_size, cfg.world.min_ranks, tc.accum_steps)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    parts = build_run(cfg, comm, device)
    state = _first_state(cfg, run_dir, parts, comm)
    release_free_memory()  # what building left free (the whole params, at ZeRO stages that shard them)
    if rank == 0:
        _announce(cfg, run_dir, parts, world_size, device)
    timeline = Timeline(rank) if tc.trace else NullTimeline()
    last_step = min(tc.max_steps, tc.stop_at or tc.max_steps)
    blocked = _not_compiled(cfg)
    choice = compiled.choose(tc.compile, run_dir.path, device.type, last_step - state.step, comm, blocked)
    if rank == 0:
        log.info(choice.message)
    loop = _Loop(cfg, parts, comm, timeline, device, state, last_step, choice.compile)
    report = Report(cfg, run_dir, parts, comm, state.step, last_step)
    status = RankStatus(run_dir, rank)
    heartbeat = Heartbeat(rank, world_size).start() if world_size > 1 and world is None else None
    # fdp.interrupt: SIGINT/SIGTERM (and SLURM's requeue signal) stop every rank after the same step.
    stop = StopSignals(stop_signal_names(cfg.world.launcher, cfg.world.requeue_signal),
                       repeat_stops_at_once=cfg.world.launcher == "none").install().join(world_size, comm.watch)
    try:
        while True:
            try:
                interrupted = loop.run(run_dir, report, status, stop)
                break
            except RuntimeError as error:
                if world is not None:
                    loop.shrink(world, error, run_dir, report, stop)
                    continue
                lost = _lost_rank_error(error, heartbeat, rank, status.step) if world_size > 1 else None
                if lost is None:
                    raise
                raise lost from error
        stop.close()
    finally:
        stop.close(finished=False)
        timeline.save(run_dir.trace(rank))
        if heartbeat is not None:
            heartbeat.stop()
        status.close()
    rows = report.times.rows
    if rank == 0 and rows:  # what this invocation measured, for the next one's trainer.compile=auto
        compiled.write_record(run_dir.path, choice, rows[0]["step_s"], report.times.median("step_s"))
    summary = report.summary(loop.state, device.type, interrupted)
    if world is not None:
        world.finish(summary)
    return summary


# -- the run ----------------------------------------------------------------------------------
def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Validate ``cfg`` and train it in ``run_dir`` on the world it names; return rank 0's summary.

    The run owns ``run_dir`` while it lasts (``fdp.rundir.own_run_dir``; under torchrun and
    SLURM rank 0 holds it).
    """
    owner = launch_rank(cfg.world.launcher) == 0
    with own_run_dir(run_dir) if owner else contextlib.nullcontext():
        return _run(cfg, run_dir)


def _run(cfg: DictConfig, run_dir: str | Path) -> dict:
    cfg = resolve_world(cfg)
    validate(cfg, run_dir)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    layout = layout_of(cfg)
    if layout.launcher != "elastic":
        return train_worker(cfg, str(run_dir))
    container = OmegaConf.to_container(cfg, resolve=True)
    try:
        results = spawn(train_worker, (container, str(run_dir)), layout)
    except WorkerFailedError as error:
        if error.signal is None:
            raise  # the worker's own one-line error
        raise RankLostError(_lost_message(RunDir(Path(run_dir)), error)) from error
    # A world that shrank: the summary of the first rank still there (rank 0 of the last world).
    kept = [results[rank] for rank in sorted(results) if not isinstance(results[rank], LostRank)]
    if not kept:
        raise RankLostError(f"every rank was lost: {', '.join(f'rank {r.rank} {r.how}' for r in results.values())}")
    return kept[0]


def _lost_message(run_dir: RunDir, error: WorkerFailedError) -> str:
    step = RankStatus.read(run_dir, error.rank).get("step")
    at = f" at step {step}" if step else " before step 1"
    steps = sorted(int(m.group(1)) for p in run_dir.checkpoints.glob("step_*.pt") if (m := re.search(r"(\d+)", p.name)))
    resume = (f"the last checkpoint is step {steps[-1]} (continue with trainer.resume=true, or set "
              "world.max_restarts to restart from it automatically)") if steps else "there is no checkpoint yet"
    return f"rank {error.rank} was lost{at}: process {error.pid} was killed by {error.signal}; the other ranks were stopped; {resume}"


def main(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Run and print the one-line summary (what ``recipes/train.py`` does)."""
    summary = run(cfg, run_dir)
    if int(os.environ.get("RANK", 0)) == 0:
        print(summary_line(summary), flush=True)
    return summary
