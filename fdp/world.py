"""Where a configured run's ranks compute: the ``world`` settings resolved on this machine.

``resolve_world`` runs once, before any worker starts (the GPUs are probed once); each
worker's ``layout_of`` then reads the same answer into the ``WorldLayout`` it joins with.
"""
from __future__ import annotations

import copy
import logging
import os

from omegaconf import DictConfig

from fdp.devices import Placement, place, probe_gpus, visible_gpus
from fdp.errors import ConfigError
from fdp.launch import ENV_LAUNCHERS, WorldLayout, refuse_world_of_one
from fdp.rundir import RUN_LOGGER
from fdp.slurm import job_world

__all__ = ["placement_of", "layout_of", "resolve_world"]


def placement_of(cfg: DictConfig, probe=None) -> Placement:
    """Where this node's ranks compute (``world.accelerator``, ``world.devices``, ``world.backend``)."""
    world = cfg.world
    local = None
    if world.launcher == "torchrun":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world.nproc_per_node))
    elif world.launcher == "slurm":
        local = job_world(os.environ).local_world_size
    return place(
        world.accelerator, world.devices, world.launcher, world.nproc_per_node, world.backend,
        visible=visible_gpus(), probe=probe, local_world_size=local,
    )


def layout_of(cfg: DictConfig) -> WorldLayout:
    """The ``WorldLayout`` this process joins for ``cfg`` (under torchrun and SLURM, read from the environment)."""
    world = cfg.world
    placement = placement_of(cfg)
    nnodes, nproc = world.nnodes, placement.nproc_per_node
    if world.launcher == "none":
        refuse_world_of_one(f"world={world.name}", "expected world=torchrun", ConfigError)
    if world.launcher == "torchrun":
        nnodes = int(os.environ.get("WORLD_SIZE", nproc)) // max(1, nproc)
    elif world.launcher == "slurm":
        job = job_world(os.environ)
        nproc, nnodes = job.local_world_size, job.world_size // job.local_world_size
    return WorldLayout(
        placement.launcher, nnodes, nproc, placement.backend, world.timeout_s, world.max_restarts,
        placement.accelerator, placement.device_ids,
    )


def resolve_world(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``world`` naming the devices, processes and backend this machine gives it.

    Busy or unusable GPUs that ``world.devices=auto`` passed over are reported on stderr.
    """
    under_launcher = cfg.world.launcher in ENV_LAUNCHERS
    # Under torchrun or SLURM each process is a rank; it checks its own GPU when it takes it.
    placement = placement_of(cfg, probe=None if under_launcher else probe_gpus)
    for index, reason in placement.unusable:
        logging.getLogger(RUN_LOGGER).warning(f"fdp: GPU {index} is busy or unusable and is left out: {reason}")  # stderr, train.log
    resolved = copy.deepcopy(cfg)  # keeps the schema: the values below are type-checked
    resolved.world.accelerator = placement.accelerator
    resolved.world.backend = placement.backend
    if not under_launcher:
        resolved.world.launcher = placement.launcher
        resolved.world.nproc_per_node = placement.nproc_per_node
    resolved.world.devices = list(placement.device_ids) if placement.accelerator == "gpu" else "auto"
    return resolved
