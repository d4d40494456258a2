"""From a config to a trained, logged and checkpointed run, on one process or many.

The entry chain, one name per step:

* ``run(cfg, run_dir)``, the Python API (the shell entry, ``fdp.run.cli.run_from_shell``, does the same
  with one line and an exit status at the end): start the run (``fdp.run.startup.start_run``: the world
  resolved, the config validated once, the directory owned), then ``run_ranks``;
* ``run_ranks``: this process's ranks: a local world's workers started with the elastic launcher
  (``fdp.spawn``), or the one rank a launcher started here;
* ``run_rank``: one rank, in its own process (kept by a keeper under ``world.on_rank_loss=shrink``,
  ``fdp.procs.keeper``): join the world, then ``_train``;
* ``_train``: ``_start`` (build the run's pieces, ``fdp.run.build``; resume or start), the loop's
  resources (stop signals, heartbeat, the rank's status, the timeline) in one ``ExitStack``, and
  ``_loop`` over the steps (``fdp.run.loop.Loop``). Under ``world.on_rank_loss=shrink`` a lost rank does not end
  the loop: the survivors regroup and go on from the last step they all completed
  (``Loop.shrink``, ``fdp.procs.shrink``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from fdp._torch import preload_compiler
from fdp.comm import Comm
from fdp.data import SPLITS, check_global_batch, has_split
from fdp.errors import ConfigError
from fdp.model import remat
from fdp.model.precision import set_matmul_precision
from fdp.model.streams import compile_refusal
from fdp.procs.allocator import PeakMemory, release_free_memory
from fdp.procs.budget import MemoryPhase, is_out_of_memory, limit_memory
from fdp.procs.grow import GrowingWorld, prepare_joiner
from fdp.procs.heartbeat import Heartbeat
from fdp.procs.interrupt import StopSignals, stop_signal_names
from fdp.procs.keeper import LostRank
from fdp.procs.launch import (
    RankLostError,
    RankOutOfMemoryError,
    RunDoesNotFit,
    WorkerFailedError,
    init_distributed,
    spawn,
)
from fdp.procs.launchers import launcher_of
from fdp.procs.shrink import ShrinkingWorld, check_shrinkable_batch, keep_rank, launched_world, shrink_store
from fdp.run.auto_stage import built_at_stage
from fdp.run.build import RunParts, build_data, display_name, node_size_of, tune_allocator_for
from fdp.run.callbacks import Callbacks, check_given
from fdp.run.checkpoint import resume
from fdp.run.forecast import built_mib, first_use_mib
from fdp.run.forecast_run import start_line
from fdp.run.loop import Loop
from fdp.run.loop_controls import LoopControls, read_resumed, run_steps
from fdp.run.micro_batch import fixed_accum
from fdp.run.out_of_memory import out_of_memory_message
from fdp.run.rank_loss import lost_message, lost_rank_error, rank_loss_of
from fdp.run.rejoin import Joining, RunEnded, enter_world
from fdp.run.report import Report, evaluated_names
from fdp.run.rundir import RankStatus, RunDir, train_log_handler
from fdp.run.startup import start_run
from fdp.run.validate import allowed_stages
from fdp.run.world import layout_of
from fdp.state.train_state import TrainState
from fdp.step import compiled
from fdp.trace import NullTimeline, Timeline

__all__ = ["run", "run_rank", "run_ranks"]

log = logging.getLogger("fdp")


# -- checkpoints of the run -----------------------------------------------------------------
def _resume_source(cfg: DictConfig, run_dir: RunDir) -> Path | None:
    """The checkpoint to start from: ``trainer.resume``'s, or this run's last after a restart of the world; or none."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    last = run_dir.last_checkpoint
    return last if restarted and last.exists() else run_dir.resume_from(cfg.trainer.resume)


def _first_state(source: Path | None, parts: RunParts, comm: Comm) -> TrainState:
    """The built state, or the checkpoint's at ``source`` (whichever format wrote it: ``fdp.run.checkpoint``)."""
    if source is None:
        return parts.state
    state = resume(source, parts.state, parts.update, parts.plan, comm)
    if comm.rank == 0:
        log.info(f"resumed from step {state.step} ({source})")
    return state


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


def _not_compiled(cfg: DictConfig, parts: RunParts) -> str | None:
    """Why this run's step cannot compile (what ``trainer.compile=auto`` says), or ``None``."""
    tc = cfg.trainer
    checkpointing = remat.resolved_mode(tc.activation_checkpointing, tc.activation_checkpointing_policy) != "none"
    reason = compile_refusal(tc.zero_stage, checkpointing)
    if reason and rank_loss_of(cfg.world).sample_streams(tc.sample_streams):
        return f"per-sample random streams (trainer.sample_streams): {reason}"
    return None


def _setup_logging(run_dir: RunDir, rank: int, joined: bool = False) -> None:
    handler: logging.Handler
    if rank == 0 and not joined:  # a rank that joined later logs to its own file, whichever launch rank it is
        handler = logging.StreamHandler(sys.stdout)
    else:
        handler = logging.FileHandler(run_dir.rank_log(rank))
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s"))
    for old in log.handlers:
        old.close()
    # What rank 0 prints also goes to Hydra's <run dir>/train.log (fdp.run.rundir).
    log.handlers[:] = (
        [handler, train_log_handler(run_dir.path, f"[rank{rank}] ")] if rank == 0 and not joined else [handler]
    )
    log.setLevel(logging.INFO)
    log.propagate = False


# -- a rank -----------------------------------------------------------------------------------
def run_rank(cfg: DictConfig, run_dir: str, callbacks: Sequence = ()) -> dict | LostRank:
    """Train on this rank until ``trainer.max_steps``; return the summary (rank 0's is the one printed).
    ``callbacks``: objects called in the loop besides ``trainer.callbacks``' (``fdp.run.callbacks``).

    Under ``world.on_rank_loss=shrink`` this process keeps the rank as its child
    (``fdp.procs.keeper``) and returns ``LostRank`` for a rank the world went on without
    (under ``torchrun`` and SLURM, the run's summary once the others are done).
    """
    cfg = OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg
    w, rank_loss = cfg.world, rank_loss_of(cfg.world)
    if rank_loss.keeps_rank(w.launcher):
        # world.respawn: the keeper starts a lost rank again, and it joins the world (fdp.procs.grow)
        return keep_rank(
            _join_and_train,
            cfg,
            run_dir,
            callbacks,
            launcher=w.launcher,
            timeout_s=w.timeout_s,
            respawn=rank_loss.respawner(),
        )
    return _join_and_train(cfg, run_dir, callbacks)


run_rank.handles_stop_signals = True  # fdp.procs.launch.spawn: it installs fdp.procs.interrupt's handlers itself


def _join_and_train(cfg: DictConfig, run_dir: str, callbacks: Sequence = ()) -> dict:
    """Join the world, train this rank in it (``_train``), leave it."""
    tune_allocator_for(cfg)
    layout = layout_of(cfg)
    rank_loss = rank_loss_of(cfg.world)
    joiner = rank_loss.joins()
    # A rank that joins a running world builds alone first, then joins (in _start, fdp.procs.grow).
    backend = prepare_joiner(layout) if joiner else None
    comm = Comm() if joiner else init_distributed(layout)
    device = layout.device(int(os.environ.get("LOCAL_RANK", 0)))
    directory = RunDir(Path(run_dir))
    phase = MemoryPhase()
    world = None
    if rank_loss.goes_on(comm.world_size, joiner):
        world = (
            Joining(launched_world(cfg.world.launcher).rank, backend)
            if joiner
            else GrowingWorld(
                shrink_store(cfg.world.timeout_s),
                comm.rank,
                comm.world_size,
                dist.get_backend(),
                cfg.world.timeout_s,
                cfg.world.min_ranks,
                max_ranks=cfg.world.max_ranks,
                group=node_size_of(cfg),
            )
        )
        comm = comm if joiner else world.comm()
    try:
        summary = _train(cfg, directory, comm, device, world, phase, callbacks)
    except RunEnded:
        summary = {}
    except (MemoryError, RuntimeError, OSError, ValueError) as error:
        if not is_out_of_memory(error):
            raise
        message = out_of_memory_message(cfg, comm.rank, comm.world_size, phase, error, phase.accum)
        # Nothing saved yet: the run does not fit (a refusal, rolled back); else it failed, its checkpoints kept.
        raise (RankOutOfMemoryError if phase.saved else RunDoesNotFit)(message) from None
    finally:
        if world is not None:
            world.close()
    # Only a rank that ended well leaves its group here. A failed one keeps it until its process exits, after the
    # launcher has its failure: destroyed now, its peers would fail on the closed connection first, and the
    # launcher could name that echo instead of the cause.
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


def _train(
    cfg: DictConfig,
    run_dir: RunDir,
    comm: Comm,
    device: torch.device,
    world: ShrinkingWorld | None = None,
    phase: MemoryPhase | None = None,
    callbacks: Sequence = (),
) -> dict:
    """This rank's run in the world of ``comm``: its start, the loop with its resources, its summary."""
    loop, report, choice = _start(cfg, run_dir, comm, device, world, phase or MemoryPhase(), callbacks)
    comm, world = loop.comm, loop.world  # a rank that joined a running world has both from there
    with contextlib.ExitStack() as resources:  # released in the reverse order: stop signals first, status last
        # By launch rank in a world that may change (ranks are renumbered as it shrinks and grows).
        status = resources.enter_context(contextlib.closing(RankStatus(run_dir, world.me if world else comm.rank)))
        heartbeat = resources.enter_context(_heartbeat(comm, world))
        resources.callback(loop.timeline.save, run_dir.trace(comm.rank))
        resources.enter_context(_closing(loop.controls))
        # The write in flight ends before the run does (not after a failure: its peers may be gone).
        resources.push(lambda failed, *_: None if failed else loop.checkpoints.wait())
        stop = resources.enter_context(_stop_signals(cfg, comm))
        interrupted = _loop(loop, run_dir, report, status, stop, heartbeat, world)
        if interrupted is None:  # the test split, once at the end (a stop signal stops at once)
            with loop.phase("evaluation", loop.state.step):
                report.tested(loop.state, loop.controls.average)
    rows = report.times.rows
    if comm.rank == 0 and rows:  # what this invocation measured, for the next one's trainer.compile=auto
        compiled.write_record(run_dir.path, choice, rows[0]["step_s"], report.times.median("step_s"))
    stopped = loop.controls.stopped_by
    if stopped is None and not interrupted and loop.state.step == cfg.trainer.stop_at < loop.controls.end_step:
        stopped = "stop_at"  # this invocation ended early as asked: trainer.resume=true goes on
    summary = report.summary(loop.state, device.type, interrupted, stopped)
    loop.callbacks.run_end(comm, loop.state, summary)
    if world is not None:
        world.finish(summary)
    return summary


def _start(
    cfg: DictConfig,
    run_dir: RunDir,
    comm: Comm,
    device: torch.device,
    world: ShrinkingWorld | None,
    phase: MemoryPhase,
    given: Sequence = (),
) -> tuple[Loop, Report, compiled.CompileChoice]:
    """This rank up to its first step: the data, the run's pieces, its first state, the step, the report."""
    rank, world_size, tc = comm.rank, comm.world_size, cfg.trainer
    joiner = isinstance(world, Joining)
    _setup_logging(run_dir, world.me if joiner else rank, joined=joiner)
    set_matmul_precision(tc.matmul_precision)  # process-wide: set once, before anything runs
    try:
        check_global_batch(cfg.data.global_batch_size, world_size)  # under torchrun the world is known only here
        if world is not None:
            check_shrinkable_batch(
                cfg.data.global_batch_size,
                world_size,
                cfg.world.min_ranks,
                fixed_accum(tc.accum_steps),
                node_size_of(cfg),
            )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    with phase("data"):
        data = build_data(cfg.data, cfg.seed)
    # torch's code that the first gradient (and a build on meta) imports is not the run's memory (a GPU's budget
    # would not count it): loaded before the budget starts.
    preload_compiler()
    limit_memory(cfg.world.memory_per_rank_mb, device)  # from here: what the run adds to the data it loaded
    peak = PeakMemory(device)  # what the summary says the run held at most, over this (fdp.run.forecast's peak)
    fixed = first_use_mib() if device.type == "cpu" else 0.0
    with phase("build"):  # to the first step: what setting up the loop holds is the build's too
        # trainer.zero_stage=auto: the stage decided (fdp.run.auto_stage); from here cfg names it
        cfg, parts, stage_choice = built_at_stage(cfg, comm, device, data, world, allowed_stages(cfg), fixed, peak.base)
        phase.stage = parts.update.stage
        source = None if joiner else _resume_source(cfg, run_dir)
        with phase("resume") if source is not None else contextlib.nullcontext():
            state = _first_state(source, parts, comm)
        # The fixed part, measured once the heap gave back what building left free (the whole params, at ZeRO stages
        # that shard them): before, it counted what the build had just freed (17 to 33 MiB from run to run on the
        # char transformer at stage 0). The forecast's trace frees all it makes: handed back again after it.
        release_free_memory()
        built = fixed + built_mib(peak.base + fixed, state) if device.type == "cpu" else 0.0
        forecast_line = start_line(cfg, parts, world_size, built) if rank == 0 and not joiner else None
        release_free_memory()
        resumed, compile = None, None
        if joiner:  # built alone: now into the running world, healed from its ranks (fdp.run.rejoin)
            world, comm, parts, state, extra = enter_world(cfg, world, parts, state, device)
            rank, world_size = comm.rank, comm.world_size
            resumed, compile = extra["controls"], extra["compile"]
            # Its own log's first line (rank<N>.log): it prints nothing else a rank other than 0 would not.
            log.info(f"started again and joined the running world at step {state.step}: rank {rank} of {world_size}")
        timeline = Timeline(rank) if tc.trace else NullTimeline()
        steps = run_steps(tc.max_steps, tc.max_epochs, parts.data, cfg.data.global_batch_size)
        last_step = min(steps, tc.stop_at or steps)
        resumed = read_resumed(source, comm) if source is not None else resumed
        splits = tuple(split for split in SPLITS if has_split(parts.data, split))
        evaluated = evaluated_names(parts.metrics, bool(tc.ema_decay)) if splits else ()
        controls = LoopControls(  # a monitor refused first
            tc, comm, parts.plan, state, splits, evaluated, steps, resumed, shard=parts.update.comm
        )
        callbacks = Callbacks.of(OmegaConf.to_container(tc.callbacks, resolve=True), given, run_dir.path, parts.plan)
        callbacks.restore((resumed or {}).get("callbacks"), comm)
        if rank == 0:
            _announce(cfg, run_dir, parts, world_size, device)
            log.info(forecast_line or "memory forecast: none (a rank joining a running world)")
        blocked = _not_compiled(cfg, parts)
        # A joiner takes the world's choice (its own is made alone: no collective the others would not make).
        choice = compiled.choose(
            tc.compile, run_dir.path, device.type, last_step - state.step, None if joiner else comm, blocked
        )
        if rank == 0:
            log.info(choice.message)
        compile = choice.compile if compile is None else compile
        loop = Loop(
            cfg,
            parts,
            comm,
            timeline,
            device,
            state,
            last_step,
            compile,
            controls,
            phase,
            world,
            callbacks,
            memory=(built, peak.base),
        )
        report = Report(cfg, run_dir, parts, comm, state.step, last_step, stage_choice)
        report.peak = peak
    return loop, report, choice


@contextlib.contextmanager
def _heartbeat(comm: Comm, world: ShrinkingWorld | None):
    """This rank's heartbeat in a world of several that does not shrink (a shrinking world beats its own)."""
    heartbeat = Heartbeat(comm.rank, comm.world_size).start() if comm.world_size > 1 and world is None else None
    try:
        yield heartbeat
    finally:
        if heartbeat is not None:
            heartbeat.stop()


@contextlib.contextmanager
def _stop_signals(cfg: DictConfig, comm: Comm):
    """fdp.procs.interrupt: SIGINT/SIGTERM (and the launcher's requeue signal) stop every rank after the same step."""
    kind = launcher_of(cfg.world.launcher)
    stop = (
        StopSignals(stop_signal_names(kind.name, cfg.world.requeue_signal), repeat_stops_at_once=kind.alone)
        .install()
        .join(comm.world_size, comm.watch)
    )
    try:
        yield stop
        stop.close()
    finally:
        stop.close(finished=False)


@contextlib.contextmanager
def _closing(controls: LoopControls):
    """The loop controls' own resources (``max_time``'s group): closed as finished, or abandoned on an error."""
    try:
        yield controls
        controls.close()
    finally:
        controls.close(finished=False)


def _loop(
    loop: Loop,
    run_dir: RunDir,
    report: Report,
    status: RankStatus,
    stop: StopSignals,
    heartbeat: Heartbeat | None,
    world: ShrinkingWorld | None,
) -> str | None:
    """Train to the last step (or the step a stop signal ends on, returned), going on without lost ranks
    in a world that shrinks; a lost rank elsewhere ends the run with a ``RankLostError`` naming it."""
    while True:
        try:
            return loop.run(run_dir, report, status, stop)
        except RuntimeError as error:
            if world is not None:
                loop.shrink(world, error, run_dir, report, stop)
                continue
            comm = loop.comm
            lost = lost_rank_error(error, heartbeat, comm.rank, status.step) if comm.world_size > 1 else None
            if lost is None:
                raise
            raise lost from error


# -- the run ----------------------------------------------------------------------------------
def run(cfg: DictConfig, run_dir: str | Path, callbacks: Sequence = ()) -> dict:
    """Validate ``cfg`` and train it in ``run_dir`` on the world it names; return rank 0's summary.

    ``callbacks``: your own objects the loop calls (``fdp.run.callbacks``), after ``trainer.callbacks``' own;
    a local world's ranks each get a copy (pickled: their classes must be importable).

    The run owns ``run_dir`` while it lasts (``fdp.run.startup.start_run``; under torchrun and
    SLURM rank 0 holds it).

    Example::

        from fdp.run.compose import compose
        summary = run(compose("world=local2", "trainer.max_steps=20"), "outputs/run1")
    """
    check_given(callbacks)
    with start_run(cfg, run_dir) as resolved:
        return run_ranks(resolved, run_dir, callbacks)


def run_ranks(cfg: DictConfig, run_dir: str | Path, callbacks: Sequence = ()) -> dict:
    """Train the ranks of a started run (``start_run``'s config) that this process runs; rank 0's summary.

    A local world's ranks are started here (``fdp.spawn``); a rank another launcher started
    (or a world of one) trains in this process.
    """
    layout = layout_of(cfg)
    if not layout.kind.spawned:
        return run_rank(cfg, str(run_dir), callbacks)
    container = OmegaConf.to_container(cfg, resolve=True)
    try:
        results = spawn(run_rank, (container, str(run_dir), tuple(callbacks)), layout)
    except WorkerFailedError as error:
        if error.signal is None:
            raise  # the worker's own one-line error
        raise RankLostError(lost_message(RunDir(Path(run_dir)), error)) from error
    # A world that shrank: the summary of the first rank still there (rank 0 of the last world).
    kept = [results[rank] for rank in sorted(results) if not isinstance(results[rank], LostRank)]
    if not kept:
        raise RankLostError(f"every rank was lost: {', '.join(f'rank {r.rank} {r.how}' for r in results.values())}")
    return kept[0]
