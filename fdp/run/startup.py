"""A run's start-up: the one path from a config to ranks ready to start, for the shell and for Python, and each
rank's own, up to its first step.

``start_run(cfg, run_dir)`` resolves the world on this machine (``fdp.run.world``), validates
the config once (``fdp.run.config.validate``), takes the run directory for the run (``fdp.run.rundir``;
under launchers that start every rank themselves, rank 0 holds it), checks what the
directory holds (a run to resume, or none) and hands the resolved config to the block.
``fdp.run.trainer.run`` (the Python API) and the shell entry (``fdp.run.cli.run_from_shell``) both
start this way, then run the ranks (``fdp.run.trainer.run_ranks``)::

    with start_run(cfg, run_dir) as resolved:
        summary = run_ranks(resolved, run_dir)

A refusal raised in the block (a bad setting, a checkpoint that does not fit, a local
world's worker refusing) leaves the directory as the run found it.

Each rank then starts with ``start_rank`` (``fdp.run.trainer``'s ``_train`` calls it): its log, the data, the
run's pieces (``fdp.run.build``, at the ZeRO stage ``fdp.run.memory.auto_stage`` decides), its first state (built, or
read from the checkpoint it resumes from: ``fdp.run.checkpoint.resume``), the memory forecast's line, the compile
choice, and the loop ready to run its first step (``fdp.run.loop.Loop``) with its report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Iterator

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
from fdp.procs.budget import MemoryPhase, limit_memory
from fdp.procs.launchers import launcher_of
from fdp.procs.shrink import ShrinkingWorld, check_shrinkable_batch
from fdp.run.build import RunParts, build_data, display_name, node_size_of
from fdp.run.callbacks import Callbacks
from fdp.run.checkpoint import resume
from fdp.run.config.validate import allowed_stages, validate, validate_run_dir
from fdp.run.loop import Loop
from fdp.run.loop_controls import LoopControls, read_resumed, run_steps
from fdp.run.memory.auto_stage import built_at_stage
from fdp.run.memory.forecast import built_mib, first_use_mib
from fdp.run.memory.micro_batch import fixed_accum
from fdp.run.memory.run_forecast import start_line
from fdp.run.rank_loss import rank_loss_of
from fdp.run.rejoin import Joining, enter_world
from fdp.run.report.records import Report, evaluated_names
from fdp.run.rundir import RUN_LOGGER, RunDir, own_run_dir, train_log_handler
from fdp.run.world import resolve_world
from fdp.state.train_state import TrainState
from fdp.step import compiled
from fdp.trace import NullTimeline, Timeline

__all__ = ["owns_run_dir", "start_rank", "start_run"]

log = logging.getLogger("fdp")


# -- the run, once -----------------------------------------------------------------------------


def owns_run_dir(cfg: DictConfig) -> bool:
    """Whether this process holds the run directory: the one starting the world, or rank 0 of a
    world whose launcher started every rank (``torchrun``, SLURM)."""
    return launcher_of(cfg.world.launcher).rank_before_joining(os.environ) == 0


@contextlib.contextmanager
def start_run(cfg: DictConfig, run_dir: str | Path, say: Callable[[str], None] | None = None) -> Iterator[DictConfig]:
    """Resolve ``cfg``'s world, validate it, own ``run_dir`` for the block; yield the resolved config.

    A mistake in the settings is told first, whoever holds the directory. ``say`` reports
    what the start-up passed over (busy GPUs, a stale lock taken over); by default the
    ``fdp.run`` logger and stderr.

    >>> import tempfile
    >>> from fdp.run.config.compose import compose
    >>> with start_run(compose(), tempfile.mkdtemp()) as resolved:
    ...     resolved.world.accelerator in ("cpu", "gpu")
    True
    """
    owner = owns_run_dir(cfg)
    notes: list[str] = []
    resolved = resolve_world(cfg, say=notes.append)  # the devices, processes and backend this machine gives it
    validate(resolved)
    with own_run_dir(run_dir, say=say) if owner else contextlib.nullcontext():
        for note in notes:  # said once the directory is the run's: train.log is its file
            (say or logging.getLogger(RUN_LOGGER).warning)(note)
        validate_run_dir(resolved, run_dir)  # what the directory holds: a run to resume, or none
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        yield resolved


# -- a rank up to its first step ---------------------------------------------------------------
def start_rank(
    cfg: DictConfig,
    run_dir: RunDir,
    comm: Comm,
    device: torch.device,
    world: ShrinkingWorld | None,
    phase: MemoryPhase,
    given: Sequence = (),
) -> tuple[Loop, Report, compiled.CompileChoice]:
    """This rank up to its first step: its log, the data, the run's pieces, its first state (built, or resumed from a
    checkpoint), the step, the report; the loop ready to run, its report and the compile choice."""
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
    peak = PeakMemory(device)  # what the summary says the run held at most, over this (fdp.run.memory.forecast's peak)
    with phase("build"):  # to the first step: what setting up the loop holds is the build's too
        fixed = first_use_mib() if device.type == "cpu" else 0.0  # the first operations' buffers: the build's
        # trainer.zero_stage=auto: the stage decided (fdp.run.memory.auto_stage); from here cfg names it
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


# -- its first state -------------------------------------------------------------------------
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


# -- what it says, and why its step would not compile ------------------------------------------
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


@contextlib.contextmanager
def rank_logging() -> Iterator[None]:
    """The ``fdp`` logger as it was before the block, once it ends: the handlers a rank sets at its start
    (``_setup_logging``: stdout, ``train.log``) are its run's, closed and detached with it, so that a later run or
    build in the same process (a notebook, a test, a world of one) logs as a fresh process does, not into a run
    directory that may be gone.

    >>> before = log.propagate
    >>> with rank_logging():
    ...     log.propagate = not before
    >>> log.propagate == before
    True
    """
    handlers, level, propagate = log.handlers[:], log.level, log.propagate
    try:
        yield
    finally:
        for handler in log.handlers:
            if handler not in handlers:
                handler.close()
        log.handlers[:] = handlers
        log.setLevel(level)
        log.propagate = propagate


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
