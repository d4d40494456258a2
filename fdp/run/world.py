"""Where a configured run's ranks compute: the ``world`` settings resolved on this machine.

``resolve_world`` runs once, before any worker starts (the GPUs are probed once); each
worker's ``layout_of`` then reads the same answer into the ``WorldLayout`` it joins with.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Callable

from omegaconf import DictConfig

from fdp.errors import ConfigError
from fdp.procs.devices import Placement, place, probe_gpus, visible_gpus
from fdp.procs.launch import WorldLayout, refuse_world_of_one
from fdp.procs.launchers import launcher_of
from fdp.run.rundir import RUN_LOGGER

__all__ = ["placement_of", "layout_of", "resolve_world"]


def placement_of(cfg: DictConfig, probe=None) -> Placement:
    """Where this node's ranks compute (``world.accelerator``, ``world.devices``, ``world.backend``)."""
    world = cfg.world
    local = launcher_of(world.launcher).local_world_size(os.environ, world.nproc_per_node)
    return place(
        world.accelerator,
        world.devices,
        world.launcher,
        world.nproc_per_node,
        world.backend,
        visible=visible_gpus(),
        probe=probe,
        local_world_size=local,
    )


def layout_of(cfg: DictConfig) -> WorldLayout:
    """The ``WorldLayout`` this process joins for ``cfg`` (under torchrun and SLURM, read from the environment)."""
    world = cfg.world
    kind = launcher_of(world.launcher)
    placement = placement_of(cfg)
    if not kind.joins_group:
        refuse_world_of_one(f"world={world.name}", "expected world=torchrun", ConfigError)
    nnodes, nproc = kind.nodes(os.environ, world.nnodes, placement.nproc_per_node)
    return WorldLayout(
        placement.launcher,
        nnodes,
        nproc,
        placement.backend,
        world.timeout_s,
        world.max_restarts,
        placement.accelerator,
        placement.device_ids,
    )


def resolve_world(cfg: DictConfig, say: Callable[[str], None] | None = None) -> DictConfig:
    """``cfg`` with ``world`` naming the devices, processes and backend this machine gives it.

    Busy or unusable GPUs that ``world.devices=auto`` passed over are reported through ``say``
    (default: the ``fdp.run`` logger, so stderr and ``train.log``).
    """
    say = say or logging.getLogger(RUN_LOGGER).warning
    under_launcher = launcher_of(cfg.world.launcher).starts_ranks
    # Under torchrun or SLURM each process is a rank; it checks its own GPU when it takes it.
    placement = placement_of(cfg, probe=None if under_launcher else probe_gpus)
    for index, reason in placement.unusable:
        say(f"fdp: GPU {index} is busy or unusable and is left out: {reason}")
    resolved = copy.deepcopy(cfg)  # keeps the schema: the values below are type-checked
    resolved.world.accelerator = placement.accelerator
    resolved.world.backend = placement.backend
    if not under_launcher:
        resolved.world.launcher = placement.launcher
        resolved.world.nproc_per_node = placement.nproc_per_node
    resolved.world.devices = list(placement.device_ids) if placement.accelerator == "gpu" else "auto"
    return resolved
