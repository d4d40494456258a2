"""From a config to a trained, logged and checkpointed run, on one process or many.

The entry chain, one name per step:

* ``run(cfg, run_dir)``, the Python API (the shell entry, ``fdp.run.cli.run_from_shell``, does the same
  with one line and an exit status at the end): start the run (``fdp.run.startup.start_run``: the world
  resolved, the config validated once, the directory owned), then ``run_ranks``;
* ``run_ranks``: this process's ranks: a local world's workers started with the elastic launcher
  (``fdp.spawn``), or the one rank a launcher started here;
* ``run_rank``: one rank, in its own process (kept by a keeper under ``world.on_rank_loss=shrink``,
  ``fdp.procs.keeper``): join the world, then ``_train``;
* ``_train``: the rank's start-up (``fdp.run.startup.start_rank``: build the run's pieces, ``fdp.run.build``;
  resume or start), the loop's
  resources (stop signals, heartbeat, the rank's status, the timeline) in one ``ExitStack``, and
  ``_loop`` over the steps (``fdp.run.loop.Loop``). Under ``world.on_rank_loss=shrink`` a lost rank does not end
  the loop: the survivors regroup and go on from the last step they all completed
  (``Loop.shrink``, ``fdp.procs.shrink``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from fdp.comm import Comm
from fdp.procs.budget import MemoryPhase, is_out_of_memory
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
from fdp.procs.shrink import ShrinkingWorld, keep_rank, launched_world, shrink_store
from fdp.run.build import node_size_of, tune_allocator_for
from fdp.run.callbacks import check_given
from fdp.run.loop import Loop
from fdp.run.loop_controls import LoopControls
from fdp.run.memory.out_of_memory import out_of_memory_message
from fdp.run.rank_loss import lost_message, lost_rank_error, rank_loss_of
from fdp.run.rejoin import Joining, RunEnded
from fdp.run.report.records import Report
from fdp.run.rundir import RankStatus, RunDir
from fdp.run.startup import rank_logging, start_rank, start_run
from fdp.run.world import layout_of
from fdp.step import compiled

__all__ = ["run", "run_rank", "run_ranks"]

log = logging.getLogger("fdp")


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
        with rank_logging():  # the fdp logger as it was once the rank ends (a world of one runs in the caller)
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
    loop, report, choice = start_rank(cfg, run_dir, comm, device, world, phase or MemoryPhase(), callbacks)
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

        from fdp.run.config.compose import compose
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
