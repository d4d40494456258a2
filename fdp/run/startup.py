"""A run's start-up: the one path from a config to ranks ready to start, for the shell and for Python.

``start_run(cfg, run_dir)`` resolves the world on this machine (``fdp.run.world``), validates
the config once (``fdp.run.validate``), takes the run directory for the run (``fdp.run.rundir``;
under launchers that start every rank themselves, rank 0 holds it), checks what the
directory holds (a run to resume, or none) and hands the resolved config to the block.
``fdp.run.trainer.run`` (the Python API) and the shell entry (``fdp.run.cli.run_from_shell``) both
start this way, then run the ranks (``fdp.run.trainer.run_ranks``)::

    with start_run(cfg, run_dir) as resolved:
        summary = run_ranks(resolved, run_dir)

A refusal raised in the block (a bad setting, a checkpoint that does not fit, a local
world's worker refusing) leaves the directory as the run found it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Callable, Iterator

from omegaconf import DictConfig

from fdp.procs.launchers import launcher_of
from fdp.run.rundir import RUN_LOGGER, own_run_dir
from fdp.run.validate import validate, validate_run_dir
from fdp.run.world import resolve_world

__all__ = ["owns_run_dir", "start_run"]


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
    >>> from fdp.run.compose import compose
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
